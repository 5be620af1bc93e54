"""Bad input through `shard-pack`: packing or indexing nothing, a text file given as a `.tar`,
refused runs. Each gets a clear message and its exit code, no traceback, and leaves nothing behind
but what a resume needs."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import tarfile

import numpy as np
import pytest

from shard_tools.cli import main
from shard_tools.pack import PackOptions, pack
from shard_tools.sa1b import Sa1bSource
from shard_tools.sample_data import write_sa1b
from shard_tools.sample_vqa import write_vqa

def _tree(folder: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture()
def jpgs_alone(tmp_path) -> pathlib.Path:
    """Three SA-1B JPEGs without their JSON files."""
    folder = tmp_path / "jpgs"
    write_sa1b(folder, images=3, size=(64, 96), masks=(2, 4), layout="folder", seed=3)
    for meta in folder.glob("*.json"):
        meta.unlink()
    return folder


def test_packing_nothing_is_a_data_error_that_writes_nothing(jpgs_alone, tmp_path, caplog):
    empty, out = tmp_path / "empty", tmp_path / "out"
    empty.mkdir()
    vqa = write_vqa(tmp_path / "vqa", "vqa-rad", {"train": 2}, per_image=(1, 2))
    (tmp_path / "no-images").mkdir()
    arrays = tmp_path / "arrays"
    arrays.mkdir()
    np.save(arrays / "x.npy", np.zeros((0, 4), np.float32))
    (arrays / "schema.json").write_text(json.dumps({"fields": {"x": {"file": "x.npy"}}}))
    cases = {
        ("sa1b", str(empty)): f"{empty}: no SA-1B samples (sa_<id>.jpg with its sa_<id>.json): found no files",
        ("sa1b", str(jpgs_alone)): f"{jpgs_alone}: no SA-1B samples (sa_<id>.jpg with its sa_<id>.json): found 3 JPEGs "
                                   "without their JSON",
        ("vqa", "--images", str(tmp_path / "no-images"), "--split", f"train={vqa['train']}"):
            f"{vqa['train']}: no vqa samples to pack (2 inputs skipped; the first: synpic50000.png: image not found",
        ("embeddings", str(arrays)): "schema.json: the arrays have no rows",
    }
    for args, message in cases.items():
        caplog.clear()
        assert main(["-q", *args, str(out)]) == 1, args
        assert message in caplog.text, (args, caplog.text)
        assert not out.exists(), f"{args}: nothing written"
    assert _tree(empty) == [] and len(_tree(jpgs_alone)) == 3


def test_indexing_nothing_is_a_data_error_that_writes_nothing(tmp_path, caplog):
    empty, out = tmp_path / "empty", tmp_path / "out"
    empty.mkdir()
    for kind in ("sa1b", "webdataset"):
        caplog.clear()
        assert main(["-q", "index", kind, str(empty), str(out)]) == 1
        assert f"{empty}: no .tar archives: nothing to index" in caplog.text
    with tarfile.open(empty / "notes.tar", "w") as archive:
        archive.add(__file__, "notes.txt")  # (neither .jpg nor .json: ignored)
    caplog.clear()
    assert main(["-q", "index", "sa1b", str(empty), str(out)]) == 1
    assert f"{empty / 'notes.tar'}: no sa1b samples: nothing to index" in caplog.text
    assert not out.exists() and _tree(empty) == ["notes.tar"]


def test_a_text_file_given_as_a_tar_or_as_json_is_a_data_error_naming_it(tmp_path, caplog):
    short, long = tmp_path / "short.tar", tmp_path / "long.tar"
    short.write_text("hello\n")
    long.write_text("not a tar, but long enough for a tar header\n" * 40)
    out = tmp_path / "out"
    for path in (short, long):
        for command in (["sa1b"], ["index", "sa1b"], ["index", "webdataset"]):
            caplog.clear()
            assert main(["-q", *command, str(path), str(out)]) == 1, (command, path)
            line = caplog.text
            assert f"{path}: not a tar archive" in line and "run the same command" not in line, (command, line)
            assert not out.exists()
    (tmp_path / "images").mkdir()
    caplog.clear()
    assert main(["-q", "vqa", str(out), "--images", str(tmp_path / "images"), "--split", f"train={short}"]) == 1
    assert f"{short}: not valid JSON" in caplog.text and not out.exists()


def test_a_refused_pack_leaves_nothing_behind(sa1b_src, tmp_path, caplog):
    src, busy = tmp_path / "src", tmp_path / "busy"
    shutil.copytree(sa1b_src, src)
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["-q", "sa1b", str(src), str(src)]) == 2  # OUT is the source folder
    assert main(["-q", "sa1b", str(src), str(busy)]) == 2
    assert "is not empty and holds no pack of these inputs" in caplog.text
    assert _tree(src) == _tree(sa1b_src) and _tree(busy) == ["notes.txt"], "no _pack/ left behind"


@dataclasses.dataclass(frozen=True)
class _Failing(Sa1bSource):
    """Raises `error` at its first sample: a run that ends before it finished a shard."""

    error: BaseException = OSError(28, "No space left on device")

    def encode(self, ref):
        raise self.error


def test_a_run_ended_before_its_first_shard_leaves_nothing_behind(sa1b_src, tmp_path):
    kept = tmp_path / "kept"  # an empty folder given as OUT: it stays
    kept.mkdir()
    for error in (OSError(28, "No space left on device"), KeyboardInterrupt()):
        for out in (tmp_path / "new" / "out", kept):
            with pytest.raises(type(error)):
                pack(_Failing(error=error), [str(sa1b_src)], str(out), PackOptions(), progress=False)
            assert not (tmp_path / "new").exists(), "the folders the run made are removed"
            assert _tree(kept) == [], "a folder that was there stays, without what the run wrote"
