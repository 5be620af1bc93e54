"""Scale-out packing and indexing on a Dask cluster: the same bytes as the local pool, also when a worker
dies; errors, stopping and progress as in the local pool."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import time
import uuid

import pytest

from pipeline.errors import InputError
from pipeline.storage import read_manifest
from shard_tools.cli import main
from shard_tools.index import index_archives
from shard_tools.pack import PackError, PackOptions, SampleRef, dask_tasks, pack
from shard_tools.sa1b import Sa1bSource

SPLITS = (("train", 0.7), ("val", 0.3))


def _files(folder: pathlib.Path | str) -> dict[str, bytes]:
    root = pathlib.Path(folder)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@dataclasses.dataclass(frozen=True)
class DyingSource(Sa1bSource):
    """Kills its worker process the first time it reaches `victim`, mid-shard (after earlier samples)."""

    marker: str = ""
    victim: str = ""

    def encode(self, ref: SampleRef):
        if ref.key == self.victim and not os.path.exists(self.marker):
            pathlib.Path(self.marker).touch()
            os._exit(1)
        return super().encode(ref)


@dataclasses.dataclass(frozen=True)
class BrokenSource(Sa1bSource):
    victim: str = ""

    def encode(self, ref: SampleRef):
        if ref.key == self.victim:
            raise RuntimeError("disk on fire")
        return super().encode(ref)


def test_local_cluster_packs_the_same_bytes_even_when_a_worker_dies(sa1b_src, sa1b_dataset, tmp_path):
    out = tmp_path / "dask"
    source = DyingSource(marker=str(tmp_path / "died"), victim="sa_5")
    pack(source, [str(sa1b_src)], str(out), PackOptions(shard_samples=3, splits=SPLITS, dask="local:2"), progress=False)
    assert (tmp_path / "died").exists(), "a worker process exited in the middle of a shard"
    assert _files(out) == _files(sa1b_dataset), "byte-identical to the local pool's output"


def test_cli_dask_flag(sa1b_src, sa1b_dataset, tmp_path):
    out = tmp_path / "cli"
    argv = ["-q", "sa1b", str(sa1b_src), str(out), "--shard-samples", "3", "--split", "train=0.7,val=0.3",
            "--dask", "local:2"]
    assert main(argv) == 0
    assert _files(out) == _files(sa1b_dataset)
    assert main(["-q", "sa1b", str(sa1b_src), str(tmp_path / "x"), "--dask", "nowhere"]) == 2


def test_a_task_that_keeps_failing_stops_the_pack_naming_its_shard(sa1b_src, tmp_path):
    options = PackOptions(shard_samples=3, splits=SPLITS, dask="local:1", task_retries=1)
    with pytest.raises(PackError, match=r"shard \w+-\d+\.tar failed on the Dask cluster after retries.*disk on fire"):
        pack(BrokenSource(victim="sa_5"), [str(sa1b_src)], str(tmp_path / "out"), options, progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


# -- shared machinery: dask_tasks, and `shard-pack index` on it ------------------------------------

@pytest.fixture(scope="module")
def cluster():
    """A cluster this process does not own, as a user's: reached by its address (tcp://...)."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as running:
        yield running.scheduler_address


def _tries(folder: str, name: str) -> int:
    """Tasks below leave a file per try: how many `name` made."""
    return len(list(pathlib.Path(folder).glob(f"{name}*")))


def _runs_until_stopped(folder: str, position: int, tick) -> int:
    pathlib.Path(folder, f"started{position}-{uuid.uuid4().hex}").touch()
    if position == 0:
        return 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            tick(0)
        except Exception as exc:
            pathlib.Path(folder, f"stopped{position}-{type(exc).__name__}").touch()
            raise
        time.sleep(0.01)
    return position


def _refuses(folder: str, tick) -> None:
    pathlib.Path(folder, f"refused-{uuid.uuid4().hex}").touch()
    raise InputError("not a tar archive", url=f"{folder}/a.tar")


def test_leaving_dask_tasks_early_stops_the_running_tasks_at_their_next_tick(cluster, tmp_path):
    calls = [(_runs_until_stopped, str(tmp_path), i) for i in range(3)]
    results = dask_tasks(cluster, calls, [f"call {i}" for i in range(3)])
    assert next(results) == (0, 0)
    deadline = time.monotonic() + 30
    while _tries(str(tmp_path), "started") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # (tasks 1 and 2 running: the second worker's, and the first's once call 0 is done)
    results.close()  # (as Ctrl-C or an error in the caller leaves it)
    while _tries(str(tmp_path), "stopped") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(p.name for p in tmp_path.glob("stopped*")) == ["stopped1-_Stopped", "stopped2-_Stopped"]
    assert _tries(str(tmp_path), "started") == 3, "a stopped task is not tried again"


def test_a_data_error_on_dask_is_raised_as_it_is_and_not_tried_again(cluster, tmp_path):
    with pytest.raises(InputError, match=r"a\.tar: not a tar archive"):
        list(dask_tasks(cluster, [(_refuses, str(tmp_path))], ["archive a.tar"], retries=2))
    assert _tries(str(tmp_path), "refused") == 1


def test_index_on_dask_is_byte_identical_to_the_local_run(sa1b_src, tmp_path, cluster):
    index_archives("sa1b", [str(sa1b_src)], str(tmp_path / "local"), splits=SPLITS, progress=False)
    index_archives("sa1b", [str(sa1b_src)], str(tmp_path / "dask"), splits=SPLITS, progress=False, dask=cluster)
    assert len(read_manifest(str(tmp_path / "local")).splits["train"]) == 2  # (one task per archive)
    assert _files(tmp_path / "dask") == _files(tmp_path / "local")


def test_cli_index_dask_flag_local_cluster(sa1b_src, tmp_path, caplog):
    (tmp_path / "webdataset").mkdir()
    for archive in sorted(sa1b_src.glob("*.tar")):
        shutil.copy(archive, tmp_path / "webdataset" / archive.name)
    argv = ["index", "webdataset", str(tmp_path / "webdataset"), "--split", "train=0.7,val=0.3"]
    assert main(["-q", *argv, str(tmp_path / "local"), "--workers", "1"]) == 0
    assert main(["-q", *argv, str(tmp_path / "dask"), "--dask", "local:2"]) == 0
    assert _files(tmp_path / "dask") == _files(tmp_path / "local")
    assert main(["-q", *argv, str(tmp_path / "x"), "--dask", "nowhere"]) == 2
    (tmp_path / "webdataset" / "notes.tar").write_text("not a tar archive\n")  # a data error: named, exit 1 as locally
    caplog.clear()
    assert main(["-q", *argv, str(tmp_path / "y"), "--dask", "local:2"]) == 1
    assert "notes.tar: not a tar archive" in caplog.text
    assert not (tmp_path / "y").exists()


def test_index_progress_on_dask_counts_archives(sa1b_src, tmp_path):
    from test_cli_errors import _stderr_on_a_terminal

    shown = _stderr_on_a_terminal(["index", "sa1b", str(sa1b_src), str(tmp_path / "out"), "--dask", "local:2"])
    counts = [int(n) for n in re.findall(r" (\d)/2 ", shown)]
    assert counts and counts[-1] == 2, shown
