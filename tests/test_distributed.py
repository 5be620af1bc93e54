"""Real torch.distributed: 2 gloo processes on loopback x 2 DataLoader workers each."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline import make_stream_loader
from conftest import split_keys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, root: str, out: str, shuffle: bool, drop_last: bool) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        loader = make_stream_loader(root, "train", batch_size=2, num_workers=2, shuffle=shuffle, drop_last=drop_last,
                                    image_size=32, mask_size=8, max_masks=2, seed=3)
        loader.set_epoch(1)
        batches = [b["keys"] for b in loader]
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, {"batches": batches, "len": len(loader), "state": loader.state_dict()})
        dist.barrier()  # a step all ranks must reach: would hang on unequal batch counts
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("shuffle", "drop_last"), [(True, True), (False, False)])
def test_two_ranks_two_workers_each_sample_once(sa1b_dataset, tmp_path, shuffle, drop_last):
    out = str(tmp_path / "ranks.json")
    mp.spawn(_rank, args=(2, _free_port(), sa1b_dataset, out, shuffle, drop_last), nprocs=2, join=True)
    with open(out) as f:
        ranks = json.load(f)
    split = split_keys(sa1b_dataset)
    keys = [k for r in ranks for b in r["batches"] for k in b]
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == ranks[0]["len"] == ranks[1]["len"] > 0
    assert len(keys) == len(set(keys))
    if drop_last:
        assert set(keys) <= set(split) and len(split) - len(keys) < 2 * 2
    else:
        assert sorted(keys) == sorted(split)
    assert ranks[0]["state"]["history"] == ranks[1]["state"]["history"] == [[2, ranks[0]["len"]]]


def _given_world(rank: int, world_size: int, port: int, root: str, out: str) -> None:
    """Each way of passing rank/world_size inside an initialised group: what it reads, or its error."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = {}
        for name, given in {"world_size only": dict(world_size=2), "rank only": dict(rank=rank),
                            "world_size=0": dict(rank=0, world_size=0), "rank 0 of 2": dict(rank=0, world_size=2),
                            "world_size=3": dict(rank=0, world_size=3), "whole split": dict(rank=0, world_size=1),
                            "own": dict(rank=rank, world_size=2), "none": {}}.items():
            try:
                loader = make_stream_loader(root, "train", batch_size=2, num_workers=0, image_size=32, mask_size=8,
                                            max_masks=2, seed=3, **given)
                results[name] = sorted(k for b in loader for k in b["keys"])
            except ValueError as exc:
                results[name] = f"ValueError: {exc}"
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, results)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


def test_given_rank_and_world_size_never_silently_duplicate(sa1b_dataset, tmp_path):
    out = str(tmp_path / "given.json")
    mp.spawn(_given_world, args=(2, _free_port(), sa1b_dataset, out), nprocs=2, join=True)
    with open(out) as f:
        ranks = json.load(f)
    for rank, results in enumerate(ranks):
        for name in ("world_size only", "rank only"):
            assert "rank and world_size go together" in results[name], (rank, name, results[name])
        assert "world_size must be an int >= 1, got 0" in results["world_size=0"]
        assert "disagree with torch.distributed (rank 1 of 2)" in results["rank 0 of 2"] if rank else \
            isinstance(results["rank 0 of 2"], list)
        assert "disagree with torch.distributed" in results["world_size=3"]
        assert results["own"] == results["none"]
    assert ranks[0]["whole split"] == ranks[1]["whole split"], "world_size=1: every process reads the whole split"
    assert not set(ranks[0]["own"]) & set(ranks[1]["own"]), "each rank its own share"
    assert set(ranks[0]["own"]) | set(ranks[1]["own"]) <= set(ranks[0]["whole split"])
