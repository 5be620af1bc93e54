"""Epoch-plan scale: one DataLoader worker's plan in a 1024-rank x 8-worker world, batch 8, one run.

    python bench/plan_scale.py [--sizes 11M 100M 1B] [--single] [--shuffle shards-then-blocks]

For each size (1000 samples per shard: 1B is 1M shards) it builds one worker's plan and takes all
its items as the loader does (each batch, and the batch `read_ahead` = 2 later): without a history,
and after a 2-stretch elastic history (1024 ranks, then 768, resumed in 1024); at 100M also mixed
with a second source (a tenth the size, cycled: weights 0.7/0.3), and resumed by a worker's own
position at 90% of its plan (as `StatefulDataLoader` resumes it: entered at its index, the items
before never computed). `--single` adds a 1-rank world with 2 workers at 100M (half the epoch for
one worker: time grows with it, memory must not).
Each case runs in a fresh subprocess: seconds (wall, and CPU: on a shared machine the wall clock
waits for other work), and the peak resident memory over what the process held before planning
(MB; the shard-size lists, as the loader holds them, are built before).
Beside them: issue 12's targets, and its figures for the plan before this one (that plan cannot
run the larger cases: no answer in 300 s at 100M with a history).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BATCH, READ_AHEAD = 8, 2
SIZES = {"11M": 11_000_000, "100M": 100_000_000, "1B": 1_000_000_000}
TARGET = "<= 2 s, <= 256 MB"
BEFORE = {  # issue 12, one worker of 1024 x 8, this machine: (samples, history) -> figures
    (11_000_000, False): "0.27 s, +87 MB",
    (11_000_000, True): "28.7 s, +853 MB",
    (100_000_000, False): "2.2 s, +772 MB",
    (100_000_000, True): "no answer in 300 s",
}


def _rss_mb() -> float:
    """Resident memory now."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    return psutil.Process().memory_info().rss / 2**20


def _peak_mb() -> float:
    """This process's peak resident memory (VmHWM: its own address space's, where ru_maxrss would
    also carry the peak of the process that started it)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _reset_peak() -> bool:
    """Start the peak (VmHWM, which ru_maxrss reports) afresh from now, where Linux allows it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(total: int, shards: int, history: bool, mix: bool, world_size: int = 1024, workers: int = 8,
            begin: float = 0.0, shuffle: str = "shards-then-window") -> dict:
    """In this process: build one worker's plan and take its items (from the `begin` fraction of them
    on); seconds and peak MB over before."""
    from pipeline.plan import Mix, Resume, World, plan_epoch, rank_batch_count

    q, r = divmod(total, shards)
    sources = [[q + 1] * r + [q] * (shards - r)]
    weights = None
    if mix:
        sources.append([1000] * max(1, total // 10_000))
        weights = Mix.of([total, sum(sources[1])], [0.7, 0.3], total)
    stretches: tuple[Resume, ...] = ()
    if history:
        second = world_size * 3 // 4 or 1
        k1 = rank_batch_count(total, world_size, 0, BATCH, True) // 3
        k2 = rank_batch_count(total, second, 0, BATCH, True, (Resume(world_size, k1),)) // 3
        stretches = (Resume(world_size, k1), Resume(second, k2))
    world = World(world_size * 101 // 200, world_size, max(0, workers // 2 - 1), workers)
    import numpy as np  # noqa: F401  (imported before the baseline, as in a worker)

    fresh_peak = _reset_peak()
    before, peak_before = _rss_mb(), _peak_mb()
    start, cpu = time.perf_counter(), time.process_time()
    plan = plan_epoch(sources, 7, 3, world, batch_size=BATCH, shuffle=shuffle, mix=weights, history=stretches)
    batches, samples = len(plan), 0
    for i in range(int(batches * begin), batches):
        samples += plan[i][2].size
        if i + READ_AHEAD < batches:
            plan[i + READ_AHEAD]
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = _peak_mb()
    return {"samples": total, "shards": shards, "history": history, "mix": mix, "world": f"{world_size} x {workers}",
            "seconds": seconds, "cpu": cpu, "mb": peak - (before if fresh_peak else max(before, peak_before)),
            "batches": batches, "yielded": samples, "begin": begin}


def plan_figures(total: int, shards: int, history: bool, mix: bool, *, world_size: int = 1024, workers: int = 8,
                 begin: float = 0.0, shuffle: str = "shards-then-window") -> dict:
    """`measure` in a fresh subprocess (its peak memory its own)."""
    argv = [sys.executable, __file__, "--child",
            json.dumps([total, shards, history, mix, world_size, workers, begin, shuffle])]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--single", action="store_true", help="also a 1-rank, 2-worker world at 100M")
    parser.add_argument("--shuffle", default="shards-then-window", help="the plan's shuffle (a name of "
                        "pipeline.plan.SHUFFLES; default the loader's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*json.loads(args.child))))
        return
    cases = [(SIZES[s], SIZES[s] // 1000, h, False, 1024, 8, 0.0) for s in args.sizes for h in (False, True)]
    if "100M" in args.sizes:
        cases += [(100_000_000, 100_000, h, True, 1024, 8, 0.0) for h in (False, True)]
        cases.append((100_000_000, 100_000, False, False, 1024, 8, 0.9))
    if args.single:
        cases.append((100_000_000, 100_000, False, False, 1, 2, 0.0))
    print(f"{'samples':>13} {'shards':>9} {'world':>9} {'history':>8} {'mix':>4} {'from':>5} {'batches':>9} "
          f"{'seconds':>8} {'cpu s':>7} {'MB':>7}  {'target':<20} before (issue 12)")
    for total, shards, history, mix, world_size, workers, begin in cases:
        f = plan_figures(total, shards, history, mix, world_size=world_size, workers=workers, begin=begin,
                         shuffle=args.shuffle)
        target = TARGET if total <= 100_000_000 and world_size > 1 else "report" if world_size > 1 else "MB bounded"
        before = BEFORE.get((total, history), "") if world_size > 1 and not mix and not begin else ""
        print(f"{total:>13,} {shards:>9,} {f['world']:>9} {'2 str.' if history else '-':>8} {'2' if mix else '-':>4} "
              f"{begin:>5.0%} {f['batches']:>9,} {f['seconds']:>8.3f} {f['cpu']:>7.3f} {f['mb']:>7.1f}  {target:<20} "
              f"{before}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
