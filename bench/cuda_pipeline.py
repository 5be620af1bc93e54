"""The CUDA path, measured: pinned batches, copies on a side stream overlapping the step, masks
unpacked on the GPU. Needs a GPU.

    python bench/cuda_pipeline.py [--images 128] [--workers 8]

1. Loader throughput with device="cuda" against device=None (CPU batches), same settings.
2. Overlap: a fixed amount of GPU work per batch (the "step"). The loader's device stage (pinned,
   non_blocking, one batch ahead on a side stream) against the plain way (pageable `.to(device)`
   on the current stream), on the same in-memory batches so only the copy strategy differs.
3. Bytes per batch over PCIe: masks bit-packed (as sent) against bool.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from pipeline import make_stream_loader  # noqa: E402
from pipeline.device import prefetch_to_cuda, to_device  # noqa: E402
from shard_tools.pack import PackOptions, pack  # noqa: E402
from shard_tools.sa1b import Sa1bSource  # noqa: E402
from shard_tools.samples.sa1b import write_sa1b  # noqa: E402

SETTINGS = dict(batch_size=8, image_size=1024, mask_size=256, max_masks=64)


def _epoch_rate(loader, epochs: int = 3) -> float:
    rates = []
    for epoch in range(epochs + 1):
        loader.set_epoch(epoch)
        torch.cuda.synchronize()
        start, n = time.perf_counter(), 0
        for batch in loader:
            n += len(batch["keys"])
            if batch["images"].is_cuda:
                batch["images"].float().mean()  # touch the data on the GPU
        torch.cuda.synchronize()
        if epoch:
            rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    device = torch.device("cuda")
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    work = pathlib.Path(tempfile.mkdtemp())
    start = time.perf_counter()
    write_sa1b(work / "src", images=args.images, size=(1500, 2250), masks=(90, 130), workers=args.workers)
    pack(Sa1bSource(), [str(work / "src")], str(work / "shards"), PackOptions(shard_samples=32, workers=args.workers),
         progress=False)
    print(f"data: {args.images} images 1500x2250 built and packed in {time.perf_counter() - start:.1f} s")
    root = str(work / "shards")

    # 1. throughput
    gpu = make_stream_loader(root, "train", num_workers=args.workers, device="cuda", **SETTINGS)
    cpu = make_stream_loader(root, "train", num_workers=args.workers, **SETTINGS)
    assert gpu._loader.pin_memory and not cpu._loader.pin_memory
    batch = next(iter(gpu))
    assert all(v.is_cuda for v in batch.values() if isinstance(v, torch.Tensor)) and batch["masks"].dtype == torch.bool
    print(f"1. loader, {args.workers} workers: device='cuda' {_epoch_rate(gpu):.1f} samples/s, "
          f"device=None {_epoch_rate(cpu):.1f} samples/s")
    del gpu, cpu

    # 2. overlap of copy and step, on the same batches in memory
    stream = make_stream_loader(root, "train", num_workers=0, **SETTINGS).stream
    finish = stream.kind.finish
    transit = list(stream)[:12]
    pinned = [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in transit]
    weight = torch.randn(4096, 4096, device=device)

    def step(b: dict, reps: int) -> None:
        y = b["images"].float().mean() + b["masks"].sum() + weight
        for _ in range(reps):
            y = torch.tanh(y @ weight)

    def timed(batches, reps: int, prefetch: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        source = prefetch_to_cuda(iter(batches), device) if prefetch else (to_device(b, device) for b in batches)
        for b in source:  # b is on the device either way; only prefetch overlaps its copy with the last step
            step(finish(b), reps)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / len(batches) * 1000

    reps = 1
    while True:  # a step of about 10 ms of GPU work
        timed(pinned[:2], reps, True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for b in pinned[:4]:
            step(finish(to_device(b, device)), reps)
        torch.cuda.synchronize()
        if (time.perf_counter() - start) / 4 > 0.010 or reps > 1 << 16:
            break
        reps *= 2
    resident = [to_device(b, device) for b in pinned]
    runs = (("the loader's device stage (pinned, side stream, one ahead)", pinned, True),
            ("pinned, copied in line (no overlap)", pinned, False),
            ("plain pageable .to(device)", transit, False),
            ("step alone, batches already on the GPU", resident, False))
    print(f"2. ms per batch, a step of {reps} 4096^2 matmuls:")
    for label, data, prefetch in runs:
        print(f"   {label:<58} {statistics.median(timed(data, reps, prefetch) for _ in range(5)):7.2f}")
    print(f"   {'copy + unpack alone (pinned, no step)':<58} {statistics.median(timed(pinned, 0, True) for _ in range(5)):7.2f}")

    # 3. bytes over PCIe
    sent = sum(v.numel() * v.element_size() for v in transit[0].values() if isinstance(v, torch.Tensor))
    unpacked = sent - transit[0]["masks_packed"].numel() + transit[0]["masks_packed"].numel() * 8
    print(f"3. bytes per batch to the GPU: {sent / 1e6:.1f} MB sent (masks packed) vs {unpacked / 1e6:.1f} MB with bool masks")


if __name__ == "__main__":
    main()
