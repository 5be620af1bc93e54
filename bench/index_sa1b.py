"""`shard-pack index sa1b` (the archives indexed in place) against `shard-pack sa1b` (packed into
new shards of 32 images, as `sa1b_loader.prepare` packs them) on the SA-1B bench data (1500x2250
images, 8 per archive): both check every pair the same way; rounds alternate, medians printed.

    python bench/index_sa1b.py [--images 128] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from sa1b_loader import prepare


def _run(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shard_tools.cli", "-q", *args], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    src = prepare(args.images) / "src"
    size = sum(p.stat().st_size for p in src.glob("*.tar"))
    archives = len(list(src.glob("*.tar")))
    times: dict[str, list[float]] = {"index": [], "pack": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(dir=src.parent) as out:
            workers = ["--workers", str(args.workers)]
            times["index"].append(_run(["index", "sa1b", str(src), os.path.join(out, "indexed"), *workers]))
            times["pack"].append(_run(["sa1b", str(src), os.path.join(out, "packed"), "--shard-samples", "32", *workers]))
            shutil.rmtree(out, ignore_errors=True)
    print(f"{args.images} images in {archives} archives, {size / 1e6:.0f} MB, {args.workers} workers, "
          f"{args.rounds} rounds (medians, each including the CLI's start)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:6s} {median:6.1f} s  {args.images / median:6.1f} images/s  {size / median / 1e6:6.1f} MB/s  "
              f"(runs: {', '.join(f'{v:.1f}' for v in values)})")
    print(f"  index / pack: {statistics.median(times['index']) / statistics.median(times['pack']):.2f}")


if __name__ == "__main__":
    main()
