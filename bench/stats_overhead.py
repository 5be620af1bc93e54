"""What `loader.stats()` costs: this tree's loader against an older commit's, paired rounds.

    python bench/stats_overhead.py [--old main] [--rounds 5] [--images 256] [--rows 20000]

The old loader is `git archive OLD pipeline` in a temporary folder; each run is a fresh subprocess
that imports `pipeline` from one tree or the other, and a round runs old then new (then new then
old in the next round: neither always goes first). Workloads: SA-1B as `make bench` sets it
(`sa1b_loader.SETTINGS`, data from its `prepare`) with 2 workers and in the main process, and
embeddings in the main process with small batches (per-batch costs show most there; data from
`embeddings_loader.prepare`). Prints each round's new/old samples/s and CPU per sample (the
process's own: all of the work when in the main process), the medians per workload, and what the
stats calls cost timed alone, as a share of the new run's wall time per batch (`accounted`): on a
busy shared VM the paired ratios wander by more than the 1% they are meant to resolve.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from sa1b_loader import ROOT, SETTINGS, run_child  # (bench/ is on the path of a script run from it)

WORKLOADS = {  # name: (data, settings, the field whose length counts samples)
    "sa1b": ("sa1b", dict(num_workers=2, **SETTINGS), "keys"),
    "sa1b-main": ("sa1b", dict(num_workers=0, **SETTINGS), "keys"),
    "embeddings": ("embeddings", dict(num_workers=0, batch_size=256), "row"),
}


def accounted(samples_per_batch: float) -> float:
    """Microseconds per batch that the stats calls cost here and now, timed alone: a batch's calls
    in the worker and the main process, and per tar sample opened those of `take` and of a kind's
    two parts (an upper bound: embeddings time no parts)."""
    import timeit

    from pipeline.stats import MAIN_STAGES, Clock, WorkerTable

    table, main = WorkerTable(("image", "masks"), 1), Clock(MAIN_STAGES, rest="other")
    clock = table.clock()

    def made() -> Iterator[tuple[None, int]]:
        while True:
            with clock.stage("decode"):
                pass
            with clock.stage("collate"):
                pass
            yield None, 8

    batches = table.timed(0, clock, made())  # (its "active" block and flush)

    def batch() -> None:
        next(batches)
        begin = time.perf_counter_ns()
        main.add("hand-off", time.perf_counter_ns() - begin)
        for stage in ("fetch", "finish", "loop"):
            with main.stage(stage):
                pass

    def sample() -> None:
        for stage in ("read", "open", "image", "masks"):
            clock.split(stage)
        clock.mark()
        clock.mark()

    n = 20000
    per_batch, per_sample = (min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6 for f in (batch, sample))
    return per_batch + samples_per_batch * per_sample


def run(tree: str, workload: str, data: str, epochs: int) -> dict:
    """One epoch to warm up, then `epochs` timed: samples/s (wall) and this process's CPU ms per
    sample (all of the work with num_workers=0; CPU time wanders less than wall time on a busy VM)."""
    sys.path.insert(0, tree)  # (before the editable install's finder)
    import pipeline
    from pipeline import make_stream_loader

    _, settings, field = WORKLOADS[workload]
    loader = make_stream_loader(data, "train", **settings)
    samples = sum(len(batch[field]) for batch in loader)  # (warm-up: page cache, workers)
    wall, cpu, samples = time.perf_counter(), time.process_time(), 0
    for epoch in range(1, epochs + 1):
        loader.set_epoch(epoch)
        samples += sum(len(batch[field]) for batch in loader)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    batches, opened = epochs * len(loader), epochs * loader.manifest.samples("train")  # (tar samples: blocks, images)
    clocked = hasattr(getattr(sys.modules.get("pipeline.stats"), "Clock", None), "stage")  # (this accounting's calls)
    share = accounted(opened / batches) / (1e6 * wall / batches) if clocked else None
    return {"rate": samples / wall, "cpu_ms": 1000 * cpu / samples, "accounted": share, "pipeline": pipeline.__file__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="main", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run (after one warm-up)")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--only", choices=list(WORKLOADS))
    parser.add_argument("--tree")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.only:
        print(json.dumps(run(args.tree, args.only, args.data, args.epochs)))
        return
    import embeddings_loader
    import sa1b_loader

    data = {"sa1b": lambda: sa1b_loader.prepare(args.images), "embeddings": lambda: embeddings_loader.prepare(args.rows)}
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old, "pipeline"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        trees = {"old": old, "new": str(ROOT)}
        for workload in args.workloads.split(","):
            shards = str(data[WORKLOADS[workload][0]]() / "shards")
            rates, cpus = [], []
            for r in range(args.rounds):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                got = {name: run_child(__file__, "--only", workload, "--tree", trees[name], "--data", shards,
                                       "--epochs", str(args.epochs)) for name in order}
                assert got["old"]["pipeline"].startswith(old) and got["new"]["pipeline"].startswith(str(ROOT))
                rates.append(got["new"]["rate"] / got["old"]["rate"])
                cpus.append(got["new"]["cpu_ms"] / got["old"]["cpu_ms"])
                print(f"{workload} round {r}: samples/s old {got['old']['rate']:.1f}, new {got['new']['rate']:.1f} "
                      f"({rates[-1]:.3f}); CPU ms/sample old {got['old']['cpu_ms']:.4f}, new "
                      f"{got['new']['cpu_ms']:.4f} ({cpus[-1]:.3f}); the stats calls alone: "
                      f"{got['new']['accounted']:.3%} of the wall time", flush=True)
            print(f"{workload}: medians of {args.rounds} rounds, new/old: samples/s {statistics.median(rates):.3f}, "
                  f"CPU per sample {statistics.median(cpus):.3f}", flush=True)


if __name__ == "__main__":
    main()
