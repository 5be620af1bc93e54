"""SA-1B batches made by the device stage (`decode_device`, issue 41) against the CPU path, in one run on
the same data, workers and settings: samples/s and CPU core-seconds per sample (all processes).

    python bench/device_decode.py [--images 128] [--workers 4] [--rounds 2] [--decode-device cuda]

With `--decode-device cuda` (a GPU; bench/gpu_check.sh's `device` step) both loaders give batches on the
GPU (`device="cuda"`: the CPU path's copied there); the issue's targets are printed beside the figures
(at least 3x the CPU path's samples/s, at most 1/4 of its CPU per sample). Then the image part alone:
a batch of JPEGs decoded and resized by nvJPEG against the CPU path's decoder, per image. With
`--decode-device cpu` (no GPU needed) the same comparison runs on CPU batches: the stage's CPU
reference, to show the bench works; its figures say nothing of the GPU.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import simplejpeg
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from pipeline import make_stream_loader  # noqa: E402
from pipeline.device import decode_jpegs, resized  # noqa: E402
from pipeline.images import decode_image  # noqa: E402
from pipeline.rle import fit  # noqa: E402
from sa1b_loader import SETTINGS, measured, packed_samples, prepare  # noqa: E402

TARGET_RATE, TARGET_CPU = 3.0, 0.25  # issue 41: device path / CPU path, 4 workers


def _loaders(shards: str, args: argparse.Namespace) -> dict:
    """The two ways, by name: (make, options) for `measured`."""
    device = "cuda" if args.decode_device == "cuda" else None
    base = dict(num_workers=args.workers, device=device, **SETTINGS)
    return {"CPU path": lambda: make_stream_loader(shards, "train", **base),
            f"decode_device={args.decode_device!r}": lambda: make_stream_loader(
                shards, "train", decode_device=args.decode_device, **base)}


def _synced(make):
    """`make()`'s loader, its batches waited for on the GPU (the pixels are made asynchronously there)."""
    loader = make()
    if not torch.cuda.is_available():
        return loader

    class Synced:
        def set_epoch(self, epoch: int) -> None:
            loader.set_epoch(epoch)

        def __iter__(self):
            for batch in loader:
                torch.cuda.synchronize()
                yield batch

    return Synced()


def compare(shards: str, args: argparse.Namespace) -> None:
    """Both loaders in alternating rounds (each in this process, workers fresh): medians per way."""
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name, make in _loaders(shards, args).items():
            runs.setdefault(name, []).append(measured(lambda: _synced(make), args.epochs))
    figures = {name: (statistics.median(r["rate"] for r in rs), statistics.median(r["cpu_ms"] for r in rs))
               for name, rs in runs.items()}
    (cpu_rate, cpu_ms), (dev_rate, dev_ms) = figures.values()
    print(f"\n{'loader':<26} {'samples/s':>10} {'CPU ms/sample':>14}")
    for name, (rate, ms) in figures.items():
        print(f"{name:<26} {rate:>10.1f} {ms:>14.1f}")
    print(f"device / CPU path: samples/s x{dev_rate / cpu_rate:.2f} (target >= x{TARGET_RATE:g}), CPU per sample "
          f"x{dev_ms / cpu_ms:.2f} (target <= x{TARGET_CPU:g})")


def transit_mb(shards: str, args: argparse.Namespace) -> None:
    """Bytes a batch crosses from a worker to the main process (and over PCIe with `device="cuda"`),
    each way, on the first batch."""
    for name, options in (("CPU path", {}), (f"decode_device={args.decode_device!r}",
                                             {"decode_device": args.decode_device})):
        stream = make_stream_loader(shards, "train", num_workers=0, **SETTINGS, **options).stream
        batch = next(iter(stream))
        size = sum(v.nbytes for v in batch.values() if isinstance(v, torch.Tensor))
        print(f"a batch in transit, {name}: {size / 1e6:.1f} MB")


def _nvimgcodec(jpegs: list[bytes], device: torch.device):
    """nvImageCodec's batched decode, then the same resize: the work, or None where it is not installed
    (its wheel: nvidia-nvimgcodec-cu13, or -cu12, with the CUDA of python3's torch)."""
    try:
        from nvidia import nvimgcodec
    except ImportError:
        return None
    decoder = nvimgcodec.Decoder()

    def work() -> None:
        for image in decoder.decode(jpegs):
            pixels = torch.as_tensor(image, device=device).permute(2, 0, 1)
            resized(pixels, fit(*pixels.shape[1:], SETTINGS["image_size"]))
        torch.cuda.synchronize()

    return work


def images_alone(shards: str, args: argparse.Namespace) -> None:
    """The image part alone, on one batch of JPEGs: the CPU path's decode at its frame (DCT scaled,
    resized) against the device stage's (one batched call, then each resized), and on a GPU against
    nvImageCodec's batched decode where it is installed (the decoder to choose by this figure); ms per image."""
    device = torch.device(args.decode_device)
    jpegs = [members["jpg"] for _, members in packed_samples(pathlib.Path(shards))][: SETTINGS["batch_size"]]
    tensors = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
    where = [("bench", str(i)) for i in range(len(jpegs))]

    def cpu_path() -> None:
        for jpeg in jpegs:
            decode_image(jpeg, fit(*simplejpeg.decode_jpeg_header(jpeg)[:2], SETTINGS["image_size"]), "bench", "k")

    def device_stage() -> None:
        for image in decode_jpegs(tensors, device, where):
            resized(image, fit(*image.shape[1:], SETTINGS["image_size"]))
        if device.type == "cuda":
            torch.cuda.synchronize()

    decoder = "torchvision's nvJPEG" if device.type == "cuda" else "libjpeg-turbo at full scale"
    ways = [("CPU path", cpu_path), (f"device stage ({decoder})", device_stage)]
    nvimgcodec = _nvimgcodec(jpegs, device) if device.type == "cuda" else None
    ways += [("nvImageCodec (cuda)", nvimgcodec)] if nvimgcodec else []
    for name, work in ways:
        work()  # (warm: libraries loaded, the decoder's state made)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        print(f"images alone, {name}: {statistics.median(times) / len(jpegs) * 1000:.2f} ms per image")
    if device.type == "cuda" and nvimgcodec is None:
        print("nvImageCodec: not installed here, not compared")
    try:
        import nvidia.dali  # noqa: F401
        print("DALI is importable, but this bench does not run it yet")
    except ImportError:
        print("DALI: not installed here, not compared")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run (after one warm-up)")
    parser.add_argument("--decode-device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.decode_device == "cuda" and not torch.cuda.is_available():
        sys.exit("--decode-device cuda needs a GPU (--decode-device cpu: the CPU reference)")
    gpu = f"GPU {torch.cuda.get_device_name()}, " if torch.cuda.is_available() else ""
    print(f"{gpu}torch {torch.__version__}, {args.workers} workers, settings {SETTINGS}")
    shards = str(prepare(args.images) / "shards")
    compare(shards, args)
    transit_mb(shards, args)
    images_alone(shards, args)


if __name__ == "__main__":
    main()
