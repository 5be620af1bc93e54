"""`make demo`: the main job end to end on small real data, from SA-1B as released to batches.

1. Build an SA-1B-shaped dataset (tar archives of sa_<id>.jpg + sa_<id>.json in SA-1B's exact
   schema) from scikit-image's bundled photographs and real segmentations of them.
2. Pack it with `shard-pack sa1b`, then `shard-pack inspect` and `shard-pack verify` it.
3. Stream it with `make_stream_loader` (on the GPU when there is one) and report throughput.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import time
from collections.abc import Sequence

import torch

from pipeline import make_stream_loader, validate_first_batch
from shard_tools.cli import main as shard_pack
from shard_tools.sample_data import write_sa1b


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shard_tools.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path(".cache/demo"), help="working folder")
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    src, out = args.work / "sa1b", args.work / "shards"

    _step(f"1/4 building {args.images} SA-1B-shaped images (750x1125, 60-120 masks each) in {src}")
    started = time.perf_counter()
    shutil.rmtree(src, ignore_errors=True)
    archives = write_sa1b(src, images=args.images, size=(750, 1125), masks=(60, 120), images_per_archive=8,
                          workers=args.workers)
    print(f"wrote {', '.join(p.name for p in archives)} in {time.perf_counter() - started:.1f} s")

    _step(f"2/4 shard-pack sa1b {src} {out}")
    shutil.rmtree(out, ignore_errors=True)
    argv = ["sa1b", str(src), str(out), "--shard-samples", "8", "--split", "train=0.8,val=0.2",
            "--workers", str(args.workers)]
    if shard_pack(argv) != 0:
        return 1

    _step(f"3/4 shard-pack inspect / verify {out}")
    if shard_pack(["inspect", str(out)]) != 0 or shard_pack(["verify", str(out)]) != 0:
        return 1

    device = "cuda" if torch.cuda.is_available() else "cpu"
    _step(f"4/4 make_stream_loader({str(out)!r}, 'train', batch_size=4, num_workers={args.workers}, device={device!r}, "
          "image_size=1024, mask_size=256, max_masks=64)")
    loader = make_stream_loader(str(out), "train", batch_size=4, num_workers=args.workers, device=device,
                                image_size=1024, mask_size=256, max_masks=64, seed=0)
    batch = validate_first_batch(loader)
    for name, value in batch.items():
        shape = f"{tuple(value.shape)} {value.dtype} on {value.device}" if isinstance(value, torch.Tensor) else value
        print(f"  {name:<17} {shape}")
    for epoch in range(3):
        loader.set_epoch(epoch)
        started = time.perf_counter()
        samples = masks = 0
        for batch in loader:
            samples += len(batch["keys"])
            masks += int(batch["mask_counts"].sum())
        seconds = time.perf_counter() - started
        print(f"epoch {epoch}: {len(loader)} batches, {samples} samples, {masks} masks in {seconds:.2f} s "
              f"({samples / seconds:.1f} samples/s); last batch {batch['keys']}")
    print("\ndemo done: packed, verified and streamed. The benchmark on SA-1B-sized images: make bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
