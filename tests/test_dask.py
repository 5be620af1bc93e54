"""Scale-out packing on a Dask cluster: the same bytes as the local pool, also when a worker dies."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest

from shard_tools.cli import main
from shard_tools.pack import PackError, PackOptions, SampleRef, pack
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
