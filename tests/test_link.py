"""Vectors an embeddings dataset holds already, linked to another dataset's samples by key
(`shard-pack link`) and attached at load time: each sample gets exactly the row whose id its key
names, read from the embeddings' shards as they are; a sample without a row is an error naming it,
or a skip counted; a link to another dataset, or to one not allowed, is refused."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
from typing import Any

import numpy as np
import pytest
import torch

from pipeline import make_stream_loader
from pipeline.errors import ConfigError, DatasetError, SampleError, ShardstreamError
from shard_tools.cli import main
from shard_tools.embeddings import pack_embeddings
from shard_tools.link import link
from shard_tools.outputs import describe_sidecar, verify_sidecar
from shard_tools.vqa import image_id

from conftest import split_keys, split_units

SA1B = dict(image_size=64, mask_size=16, max_masks=4)
SHAPE = (4, 8)


def vector(ids: np.ndarray) -> np.ndarray:
    """Each id's vector: distinct float16 values, a function of the id alone."""
    ids = np.asarray(ids, dtype=np.uint64)
    return ((ids[:, None] % np.uint64(997)).astype(np.float64) / 7 + np.arange(32)).astype(np.float16).reshape(
        -1, *SHAPE)


def pack_vectors(out: pathlib.Path, ids: np.ndarray, id_dtype: str = "int64") -> str:
    """An embeddings dataset of one row per id (in the order given): `image_id`, `teacher`."""
    src = out / "src"
    src.mkdir(parents=True)
    np.save(src / "ids.npy", np.asarray(ids).astype(id_dtype))
    np.save(src / "teacher.npy", vector(ids))
    (src / "schema.json").write_text(json.dumps({"fields": {"image_id": {"file": "ids.npy"},
                                                            "teacher": {"file": "teacher.npy"}}}))
    pack_embeddings(str(src), str(out / "emb"), rows_per_block=3, progress=False)
    return str(out / "emb")


@pytest.fixture(scope="module")
def linked(sa1b_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """(embeddings, sidecar, the one train key it has no row for): rows for every train sample but
    one, and for ids of no sample, shuffled."""
    tmp = tmp_path_factory.mktemp("link")
    keys = split_keys(sa1b_dataset)
    ids = np.array([int(k.removeprefix("sa_")) for k in keys[1:]] + [10**9 + 1, 10**9 + 2])
    emb = pack_vectors(tmp, np.random.default_rng(0).permutation(ids))
    out = str(tmp / "teacher")
    summary = link(emb, sa1b_dataset, "train", out, id_field="image_id", field="teacher", progress=False)
    assert (summary.matched, summary.samples, summary.missing_keys) == (len(keys) - 1, len(keys), (keys[0],))
    return emb, out, keys[0]


def _each(loader: Any) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for batch in loader:
        assert batch["teacher"].dtype == torch.float16 and batch["teacher"].shape[1:] == SHAPE
        for key, row in zip(batch["keys"], batch["teacher"]):
            assert key not in found
            found[key] = row.clone()
    return found


@pytest.mark.parametrize("workers", [0, 2])
def test_each_sample_gets_the_row_its_key_names_and_one_without_is_skipped_and_counted(
        sa1b_dataset: str, linked: tuple[str, str, str], workers: int) -> None:
    emb, out, missing = linked
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, drop_last=False, num_workers=workers,
                                attach={"teacher": out}, allowed_roots=[emb], on_error="skip", hflip=0.5, **SA1B)
    found = _each(loader)
    assert sorted(found) == sorted(set(split_keys(sa1b_dataset)) - {missing})
    for key, row in found.items():
        assert np.array_equal(row.numpy(), vector(np.array([int(key.removeprefix("sa_"))]))[0])  # bit for bit
    assert loader.skipped == 1
    loader.close()


def test_a_sample_without_a_row_is_an_error_naming_it(sa1b_dataset: str, linked: tuple[str, str, str]) -> None:
    emb, out, missing = linked
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, drop_last=False, attach={"teacher": out},
                                allowed_roots=[emb], **SA1B)
    with pytest.raises(SampleError, match="no row whose image_id") as caught:
        list(loader)
    assert missing in str(caught.value)


def test_a_link_is_refused_unless_its_dataset_is_allowed_and_the_one_linked(
        sa1b_dataset: str, linked: tuple[str, str, str], tmp_path: pathlib.Path) -> None:
    emb, out, _ = linked
    with pytest.raises(ConfigError, match="allowed_roots"):
        make_stream_loader(sa1b_dataset, "train", batch_size=2, attach={"teacher": out}, **SA1B)
    with pytest.raises(ConfigError, match="holds outputs of other samples"):
        make_stream_loader(sa1b_dataset, "val", batch_size=2, attach={"teacher": out}, allowed_roots=[emb], **SA1B)
    moved = tmp_path / "sidecar"
    shutil.copytree(out, moved)
    manifest = json.loads((moved / "outputs.json").read_text())
    manifest["linked"]["fingerprint"] = "0" * 64
    (moved / "outputs.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="another version of"):
        make_stream_loader(sa1b_dataset, "train", batch_size=2, attach={"teacher": str(moved)},
                           allowed_roots=[emb], **SA1B)


def test_vqa_units_each_get_their_images_row(vqa: str, tmp_path: pathlib.Path) -> None:
    """Rows keyed by the image path's 64-bit hash (`image_id`), the default pattern for VQA keys."""
    paths = {}
    for batch in make_stream_loader(vqa, "train", batch_size=4, drop_last=False):
        paths.update(zip(batch["keys"], batch["paths"]))
    emb = pack_vectors(tmp_path, np.array([image_id(p) for p in paths.values()], dtype=np.uint64), "uint64")
    link(emb, vqa, "train", str(tmp_path / "teacher"), id_field="image_id", field="teacher", progress=False)
    rows = 0
    for batch in make_stream_loader(vqa, "train", batch_size=3, drop_last=False, num_workers=2,
                                    attach={"teacher": str(tmp_path / "teacher")}, allowed_roots=[emb]):
        for key, row in zip(batch["keys"], batch["teacher"]):
            assert np.array_equal(row.numpy(), vector(np.array([image_id(paths[key])], dtype=np.uint64))[0])
            rows += 1
    assert rows == sum(units for _, units in split_units(vqa)) > len(paths)  # (a row per question)


def test_link_misuse_is_refused(sa1b_dataset: str, linked: tuple[str, str, str], tmp_path: pathlib.Path) -> None:
    emb, out, _ = linked
    with pytest.raises(ConfigError, match="not empty"):
        link(emb, sa1b_dataset, "train", out, id_field="image_id", field="teacher", progress=False)
    new = str(tmp_path / "new")
    with pytest.raises(ConfigError, match="want one integer per row"):
        link(emb, sa1b_dataset, "train", new, id_field="teacher", field="teacher", progress=False)
    with pytest.raises(ConfigError, match="finds no number in it"):
        link(emb, sa1b_dataset, "train", new, id_field="image_id", field="teacher", key_pattern=r"^x(\d+)$",
             progress=False)
    with pytest.raises(ConfigError, match="a sa1b dataset"):
        link(sa1b_dataset, sa1b_dataset, "train", new, id_field="image_id", field="teacher", progress=False)
    twice = pack_vectors(tmp_path / "twice", np.array([1, 2, 1]))
    with pytest.raises(DatasetError, match="image_id 1 is in 2 rows"):
        link(twice, sa1b_dataset, "train", new, id_field="image_id", field="teacher", progress=False)
    assert not pathlib.Path(new, "outputs.json").exists()


def test_the_cli_links_inspects_and_verifies(sa1b_dataset: str, linked: tuple[str, str, str],
                                            tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    emb, _, missing = linked
    out = str(tmp_path / "cli")
    assert main(["link", emb, sa1b_dataset, out, "--split", "train", "--id-field", "image_id", "--field", "teacher",
                 "--name", "vith"]) == 0
    printed = capsys.readouterr().out
    assert "samples matched" in printed and missing in printed and "allowed_roots" in printed
    shown = "\n".join(describe_sidecar(out))
    assert "linked to" in shown and "image_id" in shown and "field vith: float16 [4, 8]" in shown
    assert verify_sidecar(out, datasets=[sa1b_dataset], progress=False) == []
    index = next(pathlib.Path(out, "all", "index").iterdir())
    index.write_bytes(index.read_bytes()[:-8] + b"\xff" * 8)
    problems = verify_sidecar(out, progress=False)
    assert problems and str(index.name) in problems[0]
    with pytest.raises(ShardstreamError):
        list(make_stream_loader(sa1b_dataset, "train", batch_size=2, attach={"vith": out}, allowed_roots=[emb],
                                on_error="skip", **SA1B))


def test_verify_names_a_record_of_another_samples_row(sa1b_dataset: str, linked: tuple[str, str, str],
                                                      tmp_path: pathlib.Path) -> None:
    """Two records swapped, the manifest's SHA-256 made to agree: only the rows' ids tell."""
    emb, out, _ = linked
    moved = tmp_path / "swapped"
    shutil.copytree(out, moved)
    manifest = json.loads((moved / "outputs.json").read_text())
    name, _, _ = manifest["epochs"]["all"]["indexes"][0][1]  # (the second shard: every sample has a row)
    data = bytearray((moved / name).read_bytes())
    table = np.frombuffer(data, "<i8", offset=20).reshape(-1, 3).copy()
    table[[0, 1]] = table[[1, 0]]
    data[20:] = table.tobytes()
    (moved / name).write_bytes(bytes(data))
    manifest["epochs"]["all"]["indexes"][0][1][2] = hashlib.sha256(bytes(data)).hexdigest()
    (moved / "outputs.json").write_text(json.dumps(manifest))
    assert verify_sidecar(str(moved), progress=False) == []  # (each record is a row: only the keys tell)
    problems = verify_sidecar(str(moved), datasets=[sa1b_dataset], progress=False)
    assert len(problems) == 2 and all("the link says row of image_id" in p for p in problems)
