"""pipeline.kinds as a package: every registered kind checks its batches by its declared fields, and its options
validate."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch

from pipeline import make_stream_loader
from pipeline.format import KIND_NAMES
from pipeline.kinds import KINDS, kind_of
from pipeline.storage import read_manifest
from pipeline.tario import ReadLimits
from shard_tools.embeddings import pack_embeddings
from shard_tools.index import index_webdataset


def test_the_registry_is_the_formats_kinds():
    assert set(KINDS) == set(KIND_NAMES)


def _label(members: dict) -> dict:
    """A webdataset decode: the sample's key and label."""
    return {"key": members["__key__"], "label": int(members["cls"])}


@pytest.fixture(scope="module")
def datasets(sa1b_dataset, vqa, emb, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """A small dataset of every kind, and the options its loader takes."""
    src = tmp_path_factory.mktemp("wds")
    with tarfile.open(src / "part-000.tar", "w") as tar:
        for i in range(4):
            data = str(i).encode()
            info = tarfile.TarInfo(f"s{i:04d}.cls")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    index_webdataset([str(src)], str(src), progress=False)
    return {"sa1b": (sa1b_dataset, {"image_size": 64, "mask_size": 32, "max_masks": 5}),
            "vqa": (vqa, {"image_size": 32}), "embeddings": (emb, {}), "webdataset": (str(src), {"decode": _label})}


def _broken(value) -> list[tuple[str, object]]:
    """Each way a field can be wrong: (a word its message must hold, the field's value broken so)."""
    if isinstance(value, list):
        return [("tuple", tuple(value)), ("list of", value + value[:1])]
    other = torch.float64 if value.dtype != torch.float64 else torch.float32
    return [("dtype", value.to(other)), ("shape", value.unsqueeze(-1))]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_real_batch_of_every_kind_passes_its_check_and_a_wrong_field_is_named(name, datasets):
    root, options = datasets[name]
    loader = make_stream_loader(root, "train", batch_size=2, num_workers=0, **options)
    batch, kind = next(iter(loader)), loader.kind
    assert kind.check(batch, loader.epoch) == []
    fields = [field.name for field in kind.fields(loader.epoch)]
    assert set(fields) == (set() if name == "webdataset" else set(batch))  # (webdataset: the user's collate decides)
    for field in fields:
        for word, value in _broken(batch[field]):
            found = kind.check({**batch, field: value}, loader.epoch)
            assert len(found) == 1 and found[0].startswith(f"{field}: ") and word in found[0], (field, word, found)
        found = kind.check({k: v for k, v in batch.items() if k != field}, loader.epoch)
        assert len(found) == 1 and f"missing [{field!r}]" in found[0], found
    assert kind.check(None, loader.epoch)


@pytest.fixture(scope="module")
def embeddings_manifest(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("emb") / "out"
    np.save(src / "x.npy", np.arange(32, dtype=np.float32).reshape(8, 4))
    (src / "schema.json").write_text(json.dumps({"fields": {"x": {"file": "x.npy"}}}))
    pack_embeddings(str(src), str(out), progress=False)
    return read_manifest(str(out))


@pytest.mark.parametrize(("name", "good", "bad", "message"), [
    ("sa1b", {"image_size": 64, "mask_size": None}, {"image_size": 0}, "image_size must be a positive int"),
    ("sa1b", {"max_masks": 3}, {"max_masks": -1}, "max_masks must be an int >= 0"),
    ("vqa", {"per": "image", "image_size": None}, {"per": "turn"}, "per must be one of"),
    ("vqa", {"form": "trl"}, {"form": "trl", "per": "image"}, "per must be 'question'"),
    ("embeddings", {"fields": ["x"]}, {"fields": ["nope"]}, "nope"),
    ("webdataset", {"decode": dict}, {"decode": dict, "collate": 3}, "collate must be a function"),
])
def test_options_of_each_kind_validate(name, good, bad, message, embeddings_manifest):
    kind = KINDS[name]
    manifests = [embeddings_manifest] if name == "embeddings" else []
    assert isinstance(kind.of(manifests, ReadLimits(), **good).units, bool)
    with pytest.raises(ValueError, match=message):
        kind.of(manifests, ReadLimits(), **bad)


def test_an_option_no_kind_takes_is_named(embeddings_manifest):
    with pytest.raises(ValueError, match=r"embeddings datasets do not take 'bogus': neither an option of theirs \(check_values, fields, take\)"):
        kind_of([embeddings_manifest], ReadLimits(), bogus=1)


def test_verify_options_read_everything(embeddings_manifest):
    assert KINDS["embeddings"].for_verify(embeddings_manifest).options.check_values
    assert KINDS["vqa"].for_verify(embeddings_manifest).options.per == "image"
    assert KINDS["sa1b"].for_verify(embeddings_manifest).options.max_masks >= 1 << 20
