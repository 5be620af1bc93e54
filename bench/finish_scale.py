"""Finishing a sidecar's epoch at scale (`pipeline.outputs.epochs.finish_epoch`): the process that
writes an epoch's per-shard indexes holds a bounded amount of memory whatever the split's size.

    python bench/finish_scale.py --items 100000000     # 100M plan items, 64 ranks (~10 minutes, ~8 GB of disk)

A synthetic epoch: `--ranks` ranks' commits, each rank's share of a shuffled plan in chunks of
`--records` records (each commit's chunk a sparse file of its size), over shards of `--shard-items`
items. The commits are made in one subprocess, the epoch finished in another, whose peak RSS is
reported (and its RSS before, imports done) beside its time and beside what holding the epoch's records at once would take (32 bytes a
record: the finishing before 2026-11-29). Its indexes are then checked: each item's record is the
one its commit says. Prints one JSON line; never a timing assertion."""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

FOLDER = "epoch-000000"


def _sources(items: int, shard_items: int) -> list[types.SimpleNamespace]:
    sizes = np.full(-(-items // shard_items), shard_items, dtype=np.int64)
    sizes[-1] = items - shard_items * (len(sizes) - 1)
    first = np.concatenate(([0], np.cumsum(sizes)))
    return [types.SimpleNamespace(sizes=sizes, first_item=first)]


def make(out: pathlib.Path, items: int, ranks: int, records: int) -> None:
    """Every rank's commits (records: source 0, item, start, end) and sparse chunks of their sizes."""
    from pipeline.format.outputs import Commit, OutputField, chunk_name, commit_name

    order = np.random.default_rng(0).permutation(items)
    (out / FOLDER / "index").mkdir(parents=True)
    field = (OutputField("teacher", "float16", (4,)),)
    for rank in range(ranks):
        share = order[rank::ranks]
        for number, first in enumerate(range(0, len(share), records)):
            part = share[first : first + records]
            ends = np.arange(1, len(part) + 1, dtype=np.int64) * 1024
            rows = np.column_stack([np.zeros(len(part), np.int64), part, ends - 1024, ends])
            with open(out / chunk_name(FOLDER, rank, number), "wb") as f:
                f.truncate(int(ends[-1]) + 1024)
            last = first + records >= len(share)
            commit = Commit(rank, ranks, number, int(ends[-1]) + 1024, "0" * 64, rows, number + 1, {}, field, True,
                            last, {})
            (out / commit_name(FOLDER, rank, number)).write_bytes(commit.to_bytes())


def finish(out: pathlib.Path, items: int, shard_items: int) -> dict:
    from pipeline.outputs.epochs import GROUP_ITEMS, finish_epoch
    from pipeline.storage import Retry, filesystem

    fs, base = filesystem(str(out), None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (torch and the package imported)
    start = time.perf_counter()
    cpu = time.process_time()
    finish_epoch(str(out), FOLDER, {}, _sources(items, shard_items), fs, base, Retry(), required=True)
    return {"s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "group_items": GROUP_ITEMS,
            "rss_before_mb": before, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def check(out: pathlib.Path, items: int, ranks: int, shard_items: int, samples: int = 1000) -> int:
    """Items sampled at random: the record their shard's index names is the one its commit says."""
    from pipeline.format.outputs import Commit, unpack_item_index

    manifest = json.loads((out / "outputs.json").read_text())
    chunks = manifest["epochs"][FOLDER]["chunks"]
    number = {name: i for i, (name, _, _) in enumerate(chunks)}
    wrong = 0
    for item in np.random.default_rng(1).choice(items, samples, replace=False).tolist():
        shard, within = divmod(item, shard_items)
        name, size, _ = manifest["epochs"][FOLDER]["indexes"][0][shard]
        table = unpack_item_index((out / name).read_bytes(), min(shard_items, items - shard * shard_items),
                                  [c[1] for c in chunks], name)
        chunk, start, end = table[within].tolist()
        commit = Commit.from_bytes((out / chunks[chunk][0].replace(".tar", ".json")).read_bytes(), "")
        row = commit.records[commit.records[:, 1] == item]
        wrong += not (len(row) == 1 and row[0, 2:].tolist() == [start, end] and number[chunks[chunk][0]] == chunk)
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000_000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--records", type=int, default=100_000, help="records a chunk (100000)")
    parser.add_argument("--shard-items", type=int, default=10_000, help="plan items a shard (10000)")
    parser.add_argument("--step", choices=["make", "finish"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step == "make":
        make(pathlib.Path(args.out), args.items, args.ranks, args.records)
        return
    if args.step == "finish":
        print(json.dumps(finish(pathlib.Path(args.out), args.items, args.shard_items)))
        return
    with tempfile.TemporaryDirectory(prefix="finish-scale-", dir=".cache" if pathlib.Path(".cache").is_dir()
                                     else None) as tmp:
        common = [sys.executable, __file__, "--items", str(args.items), "--ranks", str(args.ranks), "--records",
                  str(args.records), "--shard-items", str(args.shard_items), "--out", tmp]
        start = time.perf_counter()
        subprocess.run([*common, "--step", "make"], check=True)
        made = time.perf_counter() - start
        result = json.loads(subprocess.run([*common, "--step", "finish"], check=True, capture_output=True,
                                           text=True).stdout.splitlines()[-1])
        wrong = check(pathlib.Path(tmp), args.items, args.ranks, args.shard_items)
    print(json.dumps({"items": args.items, "ranks": args.ranks, "shards": -(-args.items // args.shard_items),
                      "made_s": round(made, 1), **{k: round(v, 1) for k, v in result.items()},
                      "records_at_once_mb": round(32 * args.items / 2**20), "wrong_of_1000_checked": wrong}))


if __name__ == "__main__":
    main()
