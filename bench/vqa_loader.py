"""VQA loader benchmark: make_stream_loader (per question) vs the JPEG-decode-only floor, one run.

    python bench/vqa_loader.py [--images 100] [--workers 2] [--image-size 448]

Data (cached in .cache/bench-vqa/): ~100 JPEGs at 1000-2000 px long side (crops of scikit-image's
medical and grayscale sample photos, upscaled; a third grayscale) with 2-6 VQA-RAD-style questions
each, packed with `shard-pack vqa`'s library function.
(a) make_stream_loader(per="question", image_size, num_workers, batch 16): questions/s.
(b) floor: the same decode path alone (`pipeline.images.decode_image` at the same frame, one decode
    per question, bytes already in memory), in `--workers` single-threaded processes at once.
Each runs in its own subprocess, the two alternating for `--rounds` rounds; each figure is the median
over rounds of medians over passes (after a warm-up). Compare them as ratios within one run: on a
shared machine both move with the load. The CPU time per question (all processes, the loader's
workers and their start included) moves less, so it is printed too: floor CPU / loader CPU is the
loader's efficiency.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import pathlib
import resource
import statistics
import time

from sa1b_loader import packed_samples, paired_rounds, run_child, timed_epochs  # (bench/ is on the path of a script run from it)

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench-vqa"
BATCH = 16


def prepare(images: int) -> pathlib.Path:
    """Sample data (cached): JPEGs, a VQA-RAD-style train.json, and the packed shards."""
    from shard_tools.pack import PackOptions
    from shard_tools.samples.vqa import records, write_images
    from shard_tools.vqa import VqaSource, pack_vqa

    data = CACHE / f"{images}"
    if not (data / "shards" / "manifest.json").exists():
        print(f"building {images} JPEGs at 1000-2000 px (cached in {data}) ...", flush=True)
        paths = [f"synpic{50000 + i}.jpg" for i in range(images)]
        photos = write_images(data / "images", paths, long_side=(1000, 2000), seed=7,
                              styles=(("JPEG", "RGB"), ("JPEG", "RGB"), ("JPEG", "L")))
        (data / "train.json").write_text(json.dumps(records("vqa-rad", photos, (2, 6), seed=7)))
        source = VqaSource(str(data / "images"), (("train", str(data / "train.json")),))
        pack_vqa(source, str(data / "shards"), PackOptions(shard_samples=32, workers=2), progress=False)
    return data


def run_loader(data: pathlib.Path, workers: int, image_size: int, epochs: int) -> dict:
    from pipeline import make_stream_loader

    used = _cpu()
    loader = make_stream_loader(str(data / "shards"), "train", batch_size=BATCH, num_workers=workers,
                                image_size=image_size)
    timed = timed_epochs(loader, epochs, "keys")
    del loader  # the workers exit and are reaped: their CPU time is counted
    gc.collect()
    return {"rate": statistics.median(timed["rates"]), "cpu_ms": 1000 * (_cpu() - used) / timed["samples"]}


def _cpu() -> float:
    """CPU seconds of this process and its reaped children (the loader's workers)."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def _decode_share(args: tuple[list[tuple[bytes, tuple[int, int]]], int]) -> tuple[float, float]:
    """One core's decode of its share of the questions: median (wall, CPU) seconds per pass."""
    import torch

    from pipeline.images import decode_image

    torch.set_num_threads(1)  # as in a DataLoader worker
    work, passes = args
    decode_image(work[0][0], work[0][1], "m", "k")  # warm-up
    times, cpu = [], []
    for _ in range(passes):
        start, used = time.perf_counter(), time.process_time()
        for jpg, frame in work:
            decode_image(jpg, frame, "m", "k")
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - used)
    return statistics.median(times), statistics.median(cpu)


def run_floor(data: pathlib.Path, cores: int, image_size: int, passes: int = 3) -> dict:
    """Every question's image decoded to its frame, the questions split over `cores` processes running at once."""
    from pipeline.format import unpack_record
    from pipeline.rle import fit

    work = []
    for _, members in packed_samples(data / "shards"):
        record = unpack_record(members["msgpack"])
        work += [(members["jpg"], fit(*record["stored_size"], image_size))] * len(record["questions"])
    shares = [(work[c::cores], passes) for c in range(cores)]
    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        seconds, cpu = zip(*pool.map(_decode_share, shares))
    return {"rate": len(work) / max(seconds), "cpu_ms": 1000 * sum(cpu) / len(work)}


def _child(method: str, data: pathlib.Path, args: argparse.Namespace) -> dict:
    return run_child(__file__, "--only", method, "--data", str(data), "--workers", str(args.workers),
                     "--image-size", str(args.image_size), "--epochs", str(args.epochs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2, help="loader workers, and floor processes")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs of the loader (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="floor and loader runs, alternating")
    parser.add_argument("--only", choices=["loader", "floor"])
    parser.add_argument("--data", type=pathlib.Path)
    args = parser.parse_args()
    if args.only == "loader":
        print(json.dumps(run_loader(args.data, args.workers, args.image_size, args.epochs)))
        return
    if args.only == "floor":
        print(json.dumps(run_floor(args.data, args.workers, args.image_size)))
        return

    data = prepare(args.images)
    from pipeline.format import Manifest

    manifest = Manifest.from_json((data / "shards" / "manifest.json").read_bytes(), "m")
    units = manifest.splits["train"].units
    print(f"data: {manifest.samples('train')} JPEGs at 1000-2000 px, {units} questions; per='question', "
          f"image_size={args.image_size}, batch {BATCH}, num_workers={args.workers}, cores={os.cpu_count()}", flush=True)
    rounds = paired_rounds(lambda method: _child(method, data, args), args.rounds)
    floors, loaders, ratios = rounds["floor"], rounds["loader"], rounds["ratios"]
    floor, loader = (statistics.median(r["rate"] for r in runs) for runs in (floors, loaders))
    print(f"{'method':<58}{'questions/s':>12}")
    print(f"{f'(b) floor: JPEG decode to the frame only, {args.workers} processes':<58}{floor:>12.1f}")
    print(f"{'(a) make_stream_loader':<58}{loader:>12.1f}")
    floor_cpu, loader_cpu = (statistics.median(r["cpu_ms"] for r in runs) for runs in (floors, loaders))
    print(f"CPU time per question: floor {floor_cpu:.2f} ms, loader {loader_cpu:.2f} ms (all its processes); "
          f"floor / loader = {floor_cpu / loader_cpu:.0%}")
    print(f"loader / floor = {statistics.median(ratios):.0%} (median of rounds, each the loader beside the floor "
          f"run just before it; target >= 70%); rounds: {', '.join(f'{r:.0%}' for r in ratios)}")


if __name__ == "__main__":
    main()
