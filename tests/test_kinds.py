"""pipeline.kinds as a package: every registered kind has the Kind methods, and its options validate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.format import KIND_NAMES
from pipeline.kinds import KINDS, Kind, kind_of
from pipeline.storage import read_manifest
from pipeline.tario import ReadLimits
from shard_tools.embeddings import pack_embeddings

METHODS = ("of", "for_verify", "open", "decode", "collate", "finish", "unbatch", "check")


def test_the_registry_is_the_formats_kinds():
    assert set(KINDS) == set(KIND_NAMES)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_has_the_kind_methods(name, embeddings_manifest):
    kind = KINDS[name].for_verify(embeddings_manifest)
    assert isinstance(kind.grouped, bool) and isinstance(kind.units, bool) and kind.options is not None
    for method in METHODS:
        assert callable(getattr(kind, method)), f"{name}.{method}"
    assert set(METHODS) <= set(dir(Kind))


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
    with pytest.raises(ValueError, match=r"embeddings datasets do not take these options \['bogus'\].*bogus"):
        kind_of([embeddings_manifest], ReadLimits(), bogus=1)


def test_verify_options_read_everything(embeddings_manifest):
    assert KINDS["embeddings"].for_verify(embeddings_manifest).options.check_values
    assert KINDS["vqa"].for_verify(embeddings_manifest).options.per == "image"
    assert KINDS["sa1b"].for_verify(embeddings_manifest).options.max_masks >= 1 << 20
