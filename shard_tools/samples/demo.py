"""`make demo`: the main job end to end on small real data, from SA-1B as released to batches.

1. Build an SA-1B-shaped dataset (tar archives of sa_<id>.jpg + sa_<id>.json in SA-1B's exact
   schema) from scikit-image's bundled photographs and real segmentations of them.
2. Pack it with `shard-pack sa1b`, then `shard-pack inspect` and `shard-pack verify` it, and draw
   its first samples as the loader yields them (`shard-pack preview`: masks and boxes over images).
3. Stream it with `make_stream_loader` (on the GPU when there is one) and report throughput.
4. The object-storage path: start a local S3-compatible server (SeaweedFS on 127.0.0.1), pack
   the same archives straight into a bucket, and stream them back through a local shard cache.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Sequence

import s3fs
import torch

from pipeline import make_stream_loader, validate_first_batch
from shard_tools.cli import main as shard_pack
from shard_tools.samples.locals3 import AWS_ENV, SeaweedFS, storage_options
from shard_tools.samples.sa1b import write_sa1b


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shard_tools.samples.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path(".cache/demo"), help="working folder")
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-s3", action="store_true", help="skip the object-storage step")
    args = parser.parse_args(argv)
    src, out = args.work / "sa1b", args.work / "shards"

    _step(f"1/5 building {args.images} SA-1B-shaped images (750x1125, 60-120 masks each) in {src}")
    started = time.perf_counter()
    shutil.rmtree(src, ignore_errors=True)
    archives = write_sa1b(src, images=args.images, size=(750, 1125), masks=(60, 120), images_per_archive=8,
                          workers=args.workers)
    print(f"wrote {', '.join(p.name for p in archives)} in {time.perf_counter() - started:.1f} s")

    _step(f"2/5 shard-pack sa1b {src} {out}")
    shutil.rmtree(out, ignore_errors=True)
    argv = ["sa1b", str(src), str(out), "--shard-samples", "8", "--split", "train=0.8,val=0.2",
            "--workers", str(args.workers)]
    if shard_pack(argv) != 0:
        return 1

    picture = args.work / "preview.png"
    _step(f"3/5 shard-pack inspect / verify / preview {out}")
    if shard_pack(["inspect", str(out)]) != 0 or shard_pack(["verify", str(out)]) != 0:
        return 1
    if shard_pack(["preview", str(out), "--split", "train", "-n", "8", "--out", str(picture)]) != 0:
        return 1

    device = "cuda" if torch.cuda.is_available() else "cpu"
    _step(f"4/5 make_stream_loader({str(out)!r}, 'train', batch_size=4, num_workers={args.workers}, device={device!r}, "
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
    if not args.no_s3 and _object_storage(src, out, args) != 0:
        return 1
    print("\ndemo done: packed, verified and streamed. The benchmark on SA-1B-sized images: make bench")
    return 0


def _object_storage(src: pathlib.Path, local: pathlib.Path, args: argparse.Namespace) -> int:
    _step("5/5 object storage: SeaweedFS on 127.0.0.1, shard-pack into s3://demo/sa1b, stream it back")
    server = SeaweedFS(args.work / "seaweedfs")
    shutil.rmtree(server.directory, ignore_errors=True)
    try:
        server.start()
    except RuntimeError as exc:
        print(f"skipped: {exc}\n(point the loader at any bucket with storage_options; see docs/object-storage.md)")
        return 0
    saved = {name: os.environ.get(name) for name in [*AWS_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update({**AWS_ENV, "AWS_ENDPOINT_URL": server.endpoint})  # shard-pack reads credentials as s3fs does
    try:
        print(f"server at {server.endpoint}")
        s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True).mkdir("demo")
        argv = ["-q", "sa1b", str(src), "s3://demo/sa1b", "--shard-samples", "8", "--split", "train=0.8,val=0.2",
                "--workers", str(args.workers)]
        if shard_pack(argv) != 0:
            return 1
        cache = args.work / "s3-cache"
        shutil.rmtree(cache, ignore_errors=True)
        settings = dict(batch_size=4, num_workers=args.workers, image_size=1024, mask_size=256, max_masks=64, seed=0)
        keys = [k for b in make_stream_loader(str(local), "train", **settings) for k in b["keys"]]
        loader = make_stream_loader("s3://demo/sa1b", "train", storage_options=storage_options(server.endpoint),
                                    cache_dir=str(cache), cache_limit=1 << 30, **settings)
        for label in ("cache cold", "cache warm"):
            started = time.perf_counter()
            streamed = [k for b in loader for k in b["keys"]]
            seconds = time.perf_counter() - started
            same = "the same samples in the same order as from local disk" if streamed == keys else "DIFFERENT samples"
            print(f"s3://demo/sa1b, {label}: {len(streamed)} samples in {seconds:.2f} s "
                  f"({len(streamed) / seconds:.1f} samples/s); {same}")
            if streamed != keys:
                return 1
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


if __name__ == "__main__":
    sys.exit(main())
