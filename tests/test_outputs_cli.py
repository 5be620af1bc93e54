"""`shard-pack inspect` and `verify` of a sidecar of outputs (`shard_tools.outputs`), through
`shard_tools.cli.main`: what a complete and an unfinished sidecar say; verify passing, and failing on
a flipped byte, a truncated chunk, a record under another sample's key, an item index that places
two items on one record, and a dataset other than the one the outputs are of, naming what is wrong;
the same on object storage (SeaweedFS on 127.0.0.1, the options given on the command line)."""

from __future__ import annotations

import base64
import hashlib
import json
import pathlib
import re
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from pipeline import OutputWriter, make_stream_loader
from pipeline.storage import read_manifest
from shard_tools.cli import main
from shard_tools.samples.locals3 import storage_options
from conftest import new_bucket

AUGMENTED = dict(image_size=64, mask_size=16, max_masks=4, hflip=0.5, scale_jitter=(0.5, 1.5))


def teacher(images: torch.Tensor) -> torch.Tensor:
    """Each image's 8x8 block means, per channel (float16)."""
    b, c, h, w = images.shape
    return (images.float().reshape(b, c, h // 8, 8, w // 8, 8).mean((3, 5)) / 255).to(torch.float16)


def write(out: pathlib.Path, dataset: str, *, epoch: int = 0, rank: int = 0, world: int = 1, batches: int | None = None,
          keys: Callable[[list[str]], list[str]] = lambda keys: keys) -> None:
    """A rank's teacher outputs and captions of the train split's samples (its first `batches`: the
    rest left unwritten), each batch's under `keys(batch keys)`."""
    loader = make_stream_loader(dataset, "train", batch_size=2, drop_last=False, seed=5, rank=rank, world_size=world,
                                **AUGMENTED)
    loader.set_epoch(epoch)
    with OutputWriter(str(out), loader, inputs=("images",), chunk_bytes=1 if batches else 5000) as writer:
        for number, batch in enumerate(loader):
            if number == batches:
                break
            writer.write(keys(batch["keys"]), {"teacher": teacher(batch["images"]),
                                               "caption": [f"of {k}" for k in batch["keys"]]})


@pytest.fixture(scope="module")
def sidecar(sa1b_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Epochs 0 and 1 of the train split's outputs, each written by 2 ranks."""
    out = tmp_path_factory.mktemp("outputs-cli") / "teacher"
    for epoch in (0, 1):
        for rank in (0, 1):
            write(out, sa1b_dataset, epoch=epoch, rank=rank, world=2)
    return out


@pytest.fixture
def copy(sidecar: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """The sidecar's copy, to break."""
    return pathlib.Path(shutil.copytree(sidecar, tmp_path / "copy"))


def _run(capsys: pytest.CaptureFixture[str], argv: Sequence[str]) -> tuple[int, list[str]]:
    code = main(list(argv))
    return code, capsys.readouterr().out.splitlines()


def _chunks(root: pathlib.Path, folder: str) -> list[pathlib.Path]:
    return sorted((root / folder).glob("*.tar"))


def test_inspect_of_a_complete_sidecar(sidecar: pathlib.Path, sa1b_dataset: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _run(capsys, ["inspect", str(sidecar)])
    fingerprint = read_manifest(sa1b_dataset).fingerprint
    assert code == 0
    assert lines[:7] == [
        f"sidecar {sidecar}",
        f"of datasets {fingerprint[:16]} (fingerprints), split train, 9 items, kind sa1b",
        "outputs of images; seed 5 (they change with the epoch)",
        "options hflip=0.5, image_size=64, max_image_pixels=67108864, resize=longest, scale_jitter=[0.5, 1.5]",
        "records named by their samples' keys",
        "field caption: variable (msgpack)",
        "field teacher: float16 [3, 8, 8]",
    ]
    for line, folder in zip(lines[7:], ["epoch-000000", "epoch-000001"], strict=True):
        chunks = _chunks(sidecar, folder)
        assert line == f"{folder}: complete, {len(chunks)} chunks, {sum(c.stat().st_size for c in chunks)} bytes, " \
                       "9 records"
        assert len(chunks) > 2


def test_inspect_of_an_unfinished_sidecar(sa1b_dataset: str, tmp_path: pathlib.Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 done (2 of its 3 batches in its first chunk), rank 1 stopped after 1 batch: no outputs.json."""
    out = tmp_path / "half"
    write(out, sa1b_dataset, rank=0, world=2)
    write(out, sa1b_dataset, rank=1, world=2, batches=1)
    assert not (out / "outputs.json").exists()
    code, lines = _run(capsys, ["inspect", str(out)])
    assert code == 0
    assert lines[0] == f"sidecar {out}: no outputs.json yet (written once every rank's share of an epoch is committed)"
    fingerprint = read_manifest(sa1b_dataset).fingerprint
    assert lines[1] == f"of datasets {fingerprint[:16]} (fingerprints), split train, 9 items, kind sa1b"
    assert "field teacher: float16 [3, 8, 8]" in lines
    rank0 = sorted((out / "epoch-000000").glob("r00000-*.tar"))
    rank1 = (out / "epoch-000000" / "r00001-000000.tar").stat().st_size
    assert lines[-3:] == [
        "epoch-000000: being written by 2 ranks, not complete",
        f"  rank 0: 3 batches committed in {len(rank0)} chunks, {sum(c.stat().st_size for c in rank0)} bytes, "
        "5 records; done",
        f"  rank 1: 1 batches committed in 1 chunks, {rank1} bytes, 2 records; not done",
    ]
    code, lines = _run(capsys, ["-q", "verify", str(out)])
    assert code == 1 and lines == [
        f"{out}/outputs.json: missing: no epoch is complete yet",
        f"{out}/epoch-000000: not complete: 1 of its 2 ranks have committed their whole share (the writer lists "
        "the epoch in outputs.json once every rank has)",
        "verify: 2 problems",
    ]


def test_an_epoch_being_written_beside_complete_ones_is_shown_and_is_a_problem(
        sidecar: pathlib.Path, copy: pathlib.Path, sa1b_dataset: str, capsys: pytest.CaptureFixture[str]) -> None:
    write(copy, sa1b_dataset, epoch=2, rank=1, world=2, batches=1)
    code, lines = _run(capsys, ["inspect", str(copy)])
    assert code == 0 and lines[-3:] == [
        "epoch-000002: being written by 2 ranks, not complete", "  rank 0: nothing committed",
        f"  rank 1: 1 batches committed in 1 chunks, {_chunks(copy, 'epoch-000002')[0].stat().st_size} bytes, "
        "2 records; not done"]
    code, lines = _run(capsys, ["-q", "verify", str(copy)])
    assert code == 1 and len(lines) == 2 and lines[0].startswith(f"{copy}/epoch-000002: not complete: 0 of its 2")


def test_verify_passes_with_and_without_the_dataset(sidecar: pathlib.Path, sa1b_dataset: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, ["-q", "verify", str(sidecar)]) == (0, ["verify: OK"])
    assert _run(capsys, ["-q", "verify", str(sidecar), "--dataset", sa1b_dataset]) == (0, ["verify: OK"])


def _flip(path: pathlib.Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_names_a_chunk_with_a_flipped_byte_and_the_record_it_breaks(
        copy: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A byte of a value: the chunk's SHA-256; a byte of a member's tar header: also its record, by key."""
    value, header = _chunks(copy, "epoch-000000")[0], _chunks(copy, "epoch-000001")[1]
    _flip(value, 512 + 5)  # (a character of the first record's caption, its first member: still a string)
    _flip(header, 1024 + 140)  # (the first record's second member's header, its mtime: its checksum fails)
    code, lines = _run(capsys, ["-q", "verify", str(copy)])
    assert code == 1 and lines[-1] == "verify: 3 problems"
    assert re.fullmatch(rf"{value}: SHA-256 [0-9a-f]{{64}}, the manifest says [0-9a-f]{{64}}", lines[0])
    assert re.fullmatch(rf"{header}: SHA-256 [0-9a-f]{{64}}, the manifest says [0-9a-f]{{64}}", lines[1])
    assert re.fullmatch(rf"{header}: sample 'sa_\d+': in its record \(item \d of source 0, bytes 0-\d+\): tar header "
                        "checksum mismatch at byte 1024", lines[2]), lines[2]


def test_verify_names_a_truncated_chunk(copy: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    chunk = _chunks(copy, "epoch-000001")[0]
    size = chunk.stat().st_size
    chunk.write_bytes(chunk.read_bytes()[:3000])
    records = len(base64.b64decode(json.loads(chunk.with_suffix(".json").read_text())["records"])) // 32
    code, lines = _run(capsys, ["-q", "verify", str(copy)])
    assert code == 1
    assert lines == [f"{chunk}: 3000 bytes, the manifest says {size}; its {records} records are not checked",
                     "verify: 1 problems"]


def test_a_record_under_another_samples_key_is_named_with_the_dataset(sa1b_dataset: str, tmp_path: pathlib.Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Each batch's outputs under its keys in reverse: a sidecar consistent in itself (verify alone
    passes), whose records the dataset's keys show to be under their neighbours' keys."""
    out = tmp_path / "swapped"
    write(out, sa1b_dataset, keys=lambda keys: keys[::-1])
    assert _run(capsys, ["-q", "verify", str(out)]) == (0, ["verify: OK"])
    code, lines = _run(capsys, ["-q", "verify", str(out), "--dataset", sa1b_dataset])
    assert code == 1 and lines[-1] == "verify: 8 problems"  # (9 samples in batches of 2: the last one alone)
    for line in lines[:-1]:
        found = re.fullmatch(rf"{out}/epoch-000000/r00000-\d{{6}}\.tar: sample '(sa_\d+)': its record \(item \d of "
                             r"source 0, bytes \d+-\d+\) is named '(sa_\d+)'", line)
        assert found and found[1] != found[2], line


def test_an_item_index_placing_two_items_on_one_record_is_named(copy: pathlib.Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    index = sorted((copy / "epoch-000000" / "index").iterdir())[0]
    data = bytearray(index.read_bytes())
    data[-24:] = data[-48:-24]  # (the shard's last item on the record of the one before it)
    index.write_bytes(bytes(data))
    manifest = json.loads((copy / "outputs.json").read_text())
    for ref in manifest["epochs"]["epoch-000000"]["indexes"][0]:
        if ref[0].endswith(index.name):
            ref[2] = hashlib.sha256(bytes(data)).hexdigest()
    (copy / "outputs.json").write_text(json.dumps(manifest))
    chunk, start, end = np.frombuffer(bytes(data[-24:]), "<i8").tolist()
    code, lines = _run(capsys, ["-q", "verify", str(copy)])
    assert code == 1 and lines[-1] == "verify: 2 problems"
    named = copy / manifest["epochs"]["epoch-000000"]["chunks"][chunk][0]
    overlap = f"{named}: the record of item 2 of source 0 (bytes {start}-{end}) overlaps that of item 1 of source 0"
    assert overlap in lines and any("are no item's record" in line for line in lines[:-1]), lines


def test_a_dataset_the_outputs_are_not_of_is_named(sidecar: pathlib.Path, emb: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _run(capsys, ["-q", "verify", str(sidecar), "--dataset", emb])
    assert code == 1 and lines[-1] == "verify: 1 problems"
    assert re.fullmatch(rf"{emb}/manifest.json: fingerprint [0-9a-f]{{16}}, the sidecar's outputs are of "
                        r"[0-9a-f]{16}: another dataset \(or another version of it\); the records' keys are not checked "
                        "against it",
                        lines[0]), lines


def test_dataset_flag_misuse_exits_2(sidecar: pathlib.Path, sa1b_dataset: str, capsys: pytest.CaptureFixture[str],
                                     caplog: pytest.LogCaptureFixture) -> None:
    assert main(["-q", "verify", sa1b_dataset, "--dataset", sa1b_dataset]) == 2
    assert "--dataset names the datasets a sidecar of outputs is of" in caplog.text
    assert main(["-q", "verify", str(sidecar), "--dataset", sa1b_dataset, "--dataset", sa1b_dataset]) == 2
    assert "--dataset given 2 times: the sidecar is of 1 datasets" in caplog.text


def test_rows_without_keys_are_checked_by_their_plan_items(emb: str, tmp_path: pathlib.Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Embeddings (no keys): each record named x<source>-<item>, as verify finds it, with the dataset too."""
    out = tmp_path / "emb"
    loader = make_stream_loader(emb, "train", batch_size=5, drop_last=False, seed=1)
    with OutputWriter(str(out), loader) as writer:
        for batch in loader:
            writer.write(None, {"double": (batch["x"] * 2).numpy()})
    code, lines = _run(capsys, ["inspect", str(out)])
    assert code == 0 and "records named by their plan items (written without keys: x<source>-<item>)" in lines
    assert _run(capsys, ["-q", "verify", str(out), "--dataset", emb]) == (0, ["verify: OK"])


def test_a_sidecar_on_object_storage(server: Any, sidecar: pathlib.Path, sa1b_dataset: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True)
    bucket = new_bucket(server)
    fs.put(f"{sidecar}/", f"{bucket}/teacher/", recursive=True)
    fs.put(f"{sa1b_dataset}/", f"{bucket}/sa1b/", recursive=True)
    url, options = f"s3://{bucket}/teacher", ["--storage-options", json.dumps(storage_options(server.endpoint))]
    code, lines = _run(capsys, ["inspect", url, *options])
    assert code == 0 and lines[0] == f"sidecar {url}" and lines[-1].startswith("epoch-000001: complete, ")
    assert _run(capsys, ["-q", "verify", url, "--dataset", f"s3://{bucket}/sa1b", *options]) == (0, ["verify: OK"])
    chunk = _chunks(sidecar, "epoch-000000")[0]
    fs.pipe_file(f"{bucket}/teacher/epoch-000000/{chunk.name}", chunk.read_bytes()[:-1024])
    records = len(base64.b64decode(json.loads(chunk.with_suffix(".json").read_text())["records"])) // 32
    size = chunk.stat().st_size
    assert _run(capsys, ["-q", "verify", url, *options]) == (1, [
        f"{url}/epoch-000000/{chunk.name}: {size - 1024} bytes, the manifest says {size}; its {records} records are "
        "not checked", "verify: 1 problems"])
