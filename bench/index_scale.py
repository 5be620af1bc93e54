"""What opening a dataset costs as it grows: manifest bytes, `make_stream_loader` seconds and
main-process memory, each DataLoader worker's memory after its first batches, and one worker's
epoch plan in a 1024-rank x 8-worker world, for synthetic SA-1B datasets of 1M, 11M and 100M
samples (1000 per shard; `shard_tools.samples.synthetic`: real manifest and indexes, one real shard
linked under every name). The reference is the same 1M dataset written as schema 2 (per-sample
tables in the manifest), measured in the same run.

    python bench/index_scale.py [--sizes 1000000,11000000,100000000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from shard_tools.samples.synthetic import write_synthetic  # noqa: E402

TARGETS = {11_000_000: (1.0, 64), 100_000_000: (3.0, 256)}  # open seconds, main-process MB
PER_SAMPLE_TARGET = 8  # bytes of resident memory per extra sample

_OPEN = r"""
import gc, json, sys, time
import psutil
from pipeline import make_stream_loader

def rss():
    return psutil.Process().memory_info().rss

root = sys.argv[1]
gc.collect()
before = rss()
start = time.perf_counter()
loader = make_stream_loader(root, "train", batch_size=8, num_workers=2, image_size=32, mask_size=8, max_masks=2)
seconds = time.perf_counter() - start
gc.collect()
opened = rss() - before
batches = iter(loader)
for _ in range(8):
    next(batches)
workers = [c.memory_full_info().uss for c in psutil.Process().children()]
print(json.dumps({"open_s": seconds, "open_rss": opened, "batches": len(loader), "worker_uss": workers}))
"""


def _legacy(root: pathlib.Path) -> None:
    """Rewrite a synthetic dataset's manifest as schema 2 listed it: keys, offsets per sample."""
    from pipeline.storage import read_manifest, shard_indexes

    manifest = read_manifest(str(root))
    shards = []
    cache: dict[str, tuple[list[str], list[int]]] = {}
    for shard, index in shard_indexes(str(root), manifest, "train"):
        if shard.index.sha256 not in cache:
            cache[shard.index.sha256] = index.key_list(), [*index.spans[:, 0].tolist(), int(index.spans[-1, 1])]
        keys, offsets = cache[shard.index.sha256]
        shards.append({"name": shard.name, "samples": shard.samples, "bytes": shard.bytes, "sha256": shard.sha256,
                       "keys": keys, "offsets": offsets})
    obj = json.loads((root / "manifest.json").read_text())
    obj["schema_version"] = 2
    obj["splits"] = {"train": {"samples": manifest.samples("train"), "shards": shards}}
    (root / "manifest.json").write_text(json.dumps(obj, indent=1))


def _measure(root: pathlib.Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _OPEN, str(root)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["manifest_bytes"] = (root / "manifest.json").stat().st_size
    return result


def _plan(total: int, history: bool, mix: bool = False) -> dict | None:
    try:
        from bench.plan_scale import plan_figures
    except ImportError:
        return None
    return plan_figures(total, max(1, total // 1000), history, mix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,11000000,100000000")
    parser.add_argument("--dir", help="where to write the synthetic datasets (default: a temporary folder)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="shardstream-index-scale-"))
    results = {}
    for samples in sizes:
        root = work / f"n{samples}"
        if not (root / "manifest.json").exists():
            start = time.perf_counter()
            write_synthetic(root, samples)
            print(f"wrote {samples:,} samples in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        results[samples] = _measure(root)
    legacy = work / "legacy"
    if not (legacy / "manifest.json").exists():
        write_synthetic(legacy, sizes[0])
        _legacy(legacy)
    reference = _measure(legacy)

    mb = 1 << 20
    print(f"{'samples':>12} {'manifest MB':>12} {'open s':>7} {'open MB':>8} {'worker MB (uss)':>16} {'target':>14}")
    print(f"{sizes[0]:>12,} {reference['manifest_bytes'] / mb:>12.1f} {reference['open_s']:>7.2f} "
          f"{reference['open_rss'] / mb:>8.1f} {'/'.join(f'{w / mb:.0f}' for w in reference['worker_uss']):>16} "
          f"{'schema 2 (before)':>14}")
    for samples, r in results.items():
        target = TARGETS.get(samples)
        print(f"{samples:>12,} {r['manifest_bytes'] / mb:>12.1f} {r['open_s']:>7.2f} {r['open_rss'] / mb:>8.1f} "
              f"{'/'.join(f'{w / mb:.0f}' for w in r['worker_uss']):>16} "
              f"{f'<= {target[0]:g} s, {target[1]} MB' if target else '':>14}")
    if len(sizes) > 1:
        first, last = sizes[0], sizes[-1]
        per = (results[last]["open_rss"] - results[first]["open_rss"]) / (last - first)
        old = reference["open_rss"] / sizes[0]
        print(f"opening cost per extra sample: {per:.2f} B of resident memory (target <= {PER_SAMPLE_TARGET}; "
              f"schema 2: {old:.0f} B)")
    plans = [(11_000_000, False, False), (11_000_000, True, False), (100_000_000, False, False),
             (100_000_000, True, False), (100_000_000, False, True), (1_000_000_000, False, False),
             (1_000_000_000, True, False)]
    print("one worker's plan, 1024 ranks x 8 workers, batch 8 (target at 100M: <= 2 s, <= 256 MB):")
    for total, history, mix in plans:
        figures = _plan(total, history, mix)
        if figures is None:
            print("  (bench/plan_scale.py not available)")
            break
        what = "elastic history of 2 stretches" if history else "2-source mix" if mix else "fresh epoch"
        print(f"  {total:>13,} samples, {what:<31} {figures['seconds']:6.2f} s {figures['mb']:7.1f} MB")


if __name__ == "__main__":
    main()
