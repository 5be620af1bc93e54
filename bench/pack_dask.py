"""Packing throughput: the local process pool against a Dask LocalCluster, same input, one run.

    python bench/pack_dask.py [--images 128] [--workers 2]

Uses the SA-1B benchmark's cached input (see bench/sa1b_loader.py; built on first use). Each
method packs into a fresh folder; the outputs must be byte-identical. Reports images/s (median
of 3 runs each, alternating) and the Dask overhead.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from sa1b_loader import prepare  # noqa: E402

from shard_tools.pack import PackOptions, pack  # noqa: E402
from shard_tools.sa1b import Sa1bSource  # noqa: E402


def _digest(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    src = prepare(args.images) / "src"
    methods = {"local pool": None, "dask LocalCluster": f"local:{args.workers}"}
    rates: dict[str, list[float]] = {m: [] for m in methods}
    outputs = {}
    for _ in range(args.repeats):
        for method, dask in methods.items():
            out = pathlib.Path(tempfile.mkdtemp()) / "out"
            start = time.perf_counter()
            summary = pack(Sa1bSource(), [str(src)], str(out),
                           PackOptions(shard_samples=16, workers=args.workers, dask=dask), progress=False)
            rates[method].append(summary.samples / (time.perf_counter() - start))
            outputs[method] = _digest(out)
            shutil.rmtree(out.parent)
    assert outputs["local pool"] == outputs["dask LocalCluster"], "outputs differ"
    local, dask = (statistics.median(rates[m]) for m in methods)
    print(f"packing {args.images} SA-1B-shaped images (1500x2250, ~110 masks), {args.workers} processes/workers, "
          f"{args.repeats} runs each (includes pool/cluster start-up)")
    for method in methods:
        print(f"  {method:<18} {statistics.median(rates[method]):6.1f} images/s  (runs: "
              + ", ".join(f"{r:.1f}" for r in rates[method]) + ")")
    print(f"Dask overhead: {(1 - dask / local):.0%} fewer images/s than the local pool; outputs byte-identical")


if __name__ == "__main__":
    main()
