"""SA-1B loader benchmark: make_stream_loader vs a naive loader vs the decode-only floor, one run.

    python bench/sa1b_loader.py [--images 128] [--workers 2]     (or: make bench)
    python bench/sa1b_loader.py --images 256 --sam     (the cost of SAM's options, alone)
    python bench/sa1b_loader.py --images 256 --jitter  (large-scale jitter against the decode alone with it)

(a) make_stream_loader: packed shards, num_workers=2, batch 8, image 1024, masks 256, max 64.
(b) naive reference, as common tutorials do it: a map-style Dataset over the jpg/json files that
    decodes every mask with pycocotools at full resolution, then samples 64 and resizes them;
    full-resolution JPEG decode; same DataLoader settings.
(c) floor: only the decode work the batch needs (JPEG at reduced scale + the 64 sampled masks
    rasterised at 256), in one single-threaded process, on bytes already in memory, times the cores.
(c2) the same decode work split over as many processes as workers, all running at once: what the
    cores really do together (they share caches and memory bandwidth). Loader / (c2) is what the
    loader's own machinery costs; (c2) / (c) is the machine's scaling, which no loader can recover.
Besides samples/s: CPU time per sample of all of a method's processes (the steadier loader/floor
ratio on a busy machine), time to the first batch from constructing the loader, and peak memory of
the process tree (main + workers, VmHWM summed; Linux), each beside its reference from the same run.
Each runs in its own subprocess so its peak memory is its own. Timings are medians over epochs
(after a warm-up epoch); compare them as ratios within one run, never across machines.
--sam: (a) with and without SAM fine-tuning's options (SAM_OPTIONS: mask area rule, a point and a
noisy box per mask, a horizontal flip half the time), in alternating rounds; their ratio of
samples/s is what the options cost (target >= 95%).
--jitter: (a) with large-scale jitter (JITTER_OPTIONS) beside a floor with the same options and scales:
the kind's own decode of each sample alone, in one process on bytes in memory, x the cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tarfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench-sa1b"
SETTINGS = dict(batch_size=8, image_size=1024, mask_size=256, max_masks=64)
SAM_OPTIONS = dict(max_mask_area=0.9, points_per_mask=1, box_noise=0.1, hflip=0.5)
JITTER_OPTIONS = dict(scale_jitter=(0.1, 2.0))  # large-scale jitter, as SAM-HQ and SAM's later stages train


def prepare(images: int) -> pathlib.Path:
    """Sample data (cached): SA-1B archives, their extracted files, and packed shards."""
    from shard_tools.samples.sa1b import write_sa1b

    data = CACHE / f"{images}"
    if not (data / "shards" / "manifest.json").exists():
        print(f"building {images} SA-1B-shaped images at 1500x2250 (cached in {data}) ...", flush=True)
        if not (data / "files").exists():
            write_sa1b(data / "src", images=images, size=(1500, 2250), masks=(90, 130), workers=os.cpu_count() or 1)
            for archive in sorted((data / "src").glob("*.tar")):
                with tarfile.open(archive) as tar:
                    tar.extractall(data / "files", filter="data")
        _pack(data, "shards", 32)
    return data


def packed(images: int, shard_samples: int) -> pathlib.Path:
    """The packed shards of `prepare(images)` at `shard_samples` per shard (cached)."""
    data = prepare(images)
    name = "shards" if shard_samples == 32 else f"shards-{shard_samples}"
    if not (data / name / "manifest.json").exists():
        _pack(data, name, shard_samples)
    return data / name


def _pack(data: pathlib.Path, name: str, shard_samples: int) -> None:
    from shard_tools.pack import PackOptions, pack
    from shard_tools.sa1b import Sa1bSource

    pack(Sa1bSource(), [str(data / "src")], str(data / name), PackOptions(shard_samples=shard_samples, workers=2),
         progress=False)


def _peak_mb() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, children


def _proc(pid: int, name: str) -> str:
    return (pathlib.Path("/proc") / str(pid) / name).read_text()


def tree_peak_mb() -> float:
    """Peak RSS of this process plus its live children (DataLoader workers), each one's VmHWM summed:
    an upper bound of the tree's peak, as the peers were measured (Linux)."""
    pids = [os.getpid(), *(p.pid for p in multiprocessing.active_children())]
    return sum(int(next(line.split()[1] for line in _proc(pid, "status").splitlines() if line.startswith("VmHWM")))
               for pid in pids) / 1024


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process plus its live children so far (Linux)."""
    pids = [p.pid for p in multiprocessing.active_children()]
    ticks = sum(sum(map(int, _proc(pid, "stat").rsplit(")", 1)[1].split()[11:13])) for pid in pids)
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime + ticks / os.sysconf("SC_CLK_TCK")


def timed_epochs(loader, epochs: int, field: str) -> dict:
    """Epoch 0 warms the page cache and starts the workers; then, per timed epoch, samples/s (counted
    by `len(batch[field])`) and seconds to the first batch. `samples` counts every epoch's;
    `cpu_ms` is the CPU time of the process tree per sample of the timed epochs."""
    rates, first, total, timed, cpu = [], [], 0, 0, 0.0
    for epoch in range(epochs + 1):
        loader.set_epoch(epoch)
        start, n, cpu_start = time.perf_counter(), 0, tree_cpu_s()
        for i, batch in enumerate(loader):
            if i == 0 and epoch:
                first.append(time.perf_counter() - start)
            n += len(batch[field])
        total += n
        if epoch:
            rates.append(n / (time.perf_counter() - start))
            timed, cpu = timed + n, cpu + tree_cpu_s() - cpu_start
    return {"rates": rates, "first": first, "samples": total, "cpu_ms": cpu / max(timed, 1) * 1000}


def packed_samples(shards: pathlib.Path, split: str = "train"):  # -> Iterator[tuple[str, dict[str, bytes]]]
    """(key, members) of every sample of a packed split, read from memory."""
    from pipeline.storage import read_manifest, shard_indexes
    from pipeline.tario import parse_sample

    for shard, index in shard_indexes(str(shards), read_manifest(str(shards)), split):
        blob = (shards / shard.name).read_bytes()
        for i, key in enumerate(index.key_list()):
            start, end = index.span(i)
            members = parse_sample(blob[start:end], shard.name, key)
            yield key, {ext: bytes(view) for ext, view in members.items()}


def measured(make, epochs: int) -> dict:
    """The figures of the loader `make()` builds (with `set_epoch`, batches with "keys"): the time to
    its first batch from constructing it, then `timed_epochs`, then its process tree's peak. Imports
    come before the call: they are not the loader's."""
    start = time.perf_counter()
    loader = make()
    next(iter(loader))
    cold = time.perf_counter() - start  # from constructing the loader, workers started on the way
    timed = timed_epochs(loader, epochs, "keys")
    tree = tree_peak_mb()
    del loader
    return {"rate": statistics.median(timed["rates"]), "first_batch_s": statistics.median(timed["first"]),
            "cold_first_batch_s": cold, "cpu_ms": timed["cpu_ms"], "peak_mb": _peak_mb(), "tree_mb": tree,
            "epoch_samples": timed["samples"] / (epochs + 1)}


def run_loader(data: pathlib.Path, workers: int, epochs: int, **options) -> dict:
    from pipeline import make_stream_loader

    return measured(lambda: make_stream_loader(str(data / "shards"), "train", num_workers=workers, **SETTINGS,
                                               **options), epochs)


class NaiveDataset:
    """The tutorial way: full-resolution decode of the image and of every mask, then sample."""

    def __init__(self, files: pathlib.Path) -> None:
        self.keys = sorted(p.stem for p in files.glob("*.jpg"))
        self.files = files

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> dict:
        import torch
        from PIL import Image
        from pycocotools import mask as mask_utils

        key, size, msize, limit = self.keys[i], SETTINGS["image_size"], SETTINGS["mask_size"], SETTINGS["max_masks"]
        meta = json.loads((self.files / f"{key}.json").read_text())
        image = Image.open(self.files / f"{key}.jpg").convert("RGB")
        w, h = image.size
        scale = size / max(h, w)
        image = np.asarray(image.resize((round(w * scale), round(h * scale)), Image.Resampling.BILINEAR))
        masks = mask_utils.decode([a["segmentation"] for a in meta["annotations"]])  # (H, W, N) at full size
        chosen = np.sort(np.random.default_rng(i).choice(masks.shape[2], min(limit, masks.shape[2]), replace=False))
        mh, mw = round(h * msize / max(h, w)), round(w * msize / max(h, w))
        ys, xs = (np.arange(mh) * h) // mh, (np.arange(mw) * w) // mw
        small = masks[ys][:, xs][:, :, chosen].transpose(2, 0, 1)
        out_image = torch.zeros(3, size, size, dtype=torch.uint8)
        out_image[:, : image.shape[0], : image.shape[1]] = torch.from_numpy(image.copy()).permute(2, 0, 1)
        out_masks = torch.zeros(limit, msize, msize, dtype=torch.bool)
        out_masks[: len(chosen), :mh, :mw] = torch.from_numpy(small.astype(bool))
        return {"images": out_image, "masks": out_masks}


def run_naive(data: pathlib.Path, workers: int, samples: int) -> dict:
    import torch

    dataset = NaiveDataset(data / "files")
    subset = torch.utils.data.Subset(dataset, range(min(samples, len(dataset))))
    begin = time.perf_counter()
    loader = torch.utils.data.DataLoader(subset, batch_size=SETTINGS["batch_size"], num_workers=workers,
                                         persistent_workers=workers > 0)  # (alive at the end: their peak is read)
    start, n = time.perf_counter(), 0
    for i, batch in enumerate(loader):
        if i == 0:
            start = time.perf_counter()  # workers started, first batch in: the steady state begins
            cold = start - begin
        else:
            n += len(batch["images"])
    return {"rate": n / (time.perf_counter() - start), "cold_first_batch_s": cold, "peak_mb": _peak_mb(),
            "tree_mb": tree_peak_mb()}


def _floor_work(data: pathlib.Path) -> list[tuple]:
    """(key, jpg, counts, height, width) of every sample: the floor's input, in memory."""
    from pipeline.format import unpack_record

    work = []
    for key, members in packed_samples(data / "shards"):
        record = unpack_record(members["msgpack"])
        work.append((key, members["jpg"], record["counts"], record["image"]["height"], record["image"]["width"]))
    return work


def _floor_passes(work: list[tuple], passes: int = 3) -> tuple[list[float], list[float]]:
    """Seconds and CPU seconds per sample of the decode work alone on one core: the first batch
    (cold), then `passes` passes over `work`."""
    import torch

    from pipeline.kinds.sa1b import choose_masks, decode_image
    from pipeline.rle import fit, raster

    torch.set_num_threads(1)  # as in a DataLoader worker: the floor is one core's work
    seconds, cpu = [], []
    for n in (SETTINGS["batch_size"], *[len(work)] * passes):
        start, cpu_start = time.perf_counter(), time.process_time()
        for key, jpg, counts, height, width in work[:n]:
            decode_image(jpg, fit(height, width, SETTINGS["image_size"]), "m", key)
            chosen = choose_masks(len(counts), SETTINGS["max_masks"], 0, 0, key)
            raster([counts[i] for i in chosen], (height, width), fit(height, width, SETTINGS["mask_size"]))
        seconds.append((time.perf_counter() - start) / n)
        cpu.append((time.process_time() - cpu_start) / n)
    return seconds, cpu


def run_floor(data: pathlib.Path, cores: int) -> dict:
    """One core's decode rate over the loader's own samples (median of 3 passes) x cores: the issue's floor."""
    seconds, cpu = _floor_passes(_floor_work(data))
    per_sample = statistics.median(seconds[1:])
    return {"rate": cores / per_sample, "per_sample_ms": per_sample * 1000, "cpu_ms": statistics.median(cpu[1:]) * 1000,
            "first_batch_s": seconds[0] * SETTINGS["batch_size"], "peak_mb": _peak_mb()}


def _floor_share(work: list[tuple]) -> tuple[float, float]:
    seconds, cpu = _floor_passes(work)
    return statistics.median(seconds[1:]) * len(work), statistics.median(cpu[1:]) * len(work)


def run_kind_floor(data: pathlib.Path, cores: int, options: dict) -> dict:
    """One core's rate of the kind's own open + decode with `options`, on the samples in memory (no
    reading, collating or hand-over), x cores: the floor for options the hand-written floor lacks."""
    import torch

    from pipeline.format import Manifest
    from pipeline.kinds import kind_of
    from pipeline.stats import Clock
    from pipeline.tario import ReadLimits

    torch.set_num_threads(1)
    manifest = Manifest.from_json((data / "shards" / "manifest.json").read_bytes(), "m")
    settings = {k: v for k, v in SETTINGS.items() if k != "batch_size"}
    kind = kind_of([manifest], ReadLimits(), **settings, **options)
    samples = list(packed_samples(data / "shards"))
    seconds, cpu = [], []
    for _ in range(3):
        start, cpu_start = time.perf_counter(), time.process_time()
        for key, members in samples:
            opened = kind.open(members, url="m", key=key, units=1)
            kind.decode(opened, unit=0, seed=0, epoch=0, url="m", key=key, clock=Clock(kind.stages))
        seconds.append((time.perf_counter() - start) / len(samples))
        cpu.append((time.process_time() - cpu_start) / len(samples))
    return {"rate": cores / statistics.median(seconds), "cpu_ms": statistics.median(cpu) * 1000}


def run_floor_together(data: pathlib.Path, cores: int) -> dict:
    """The same decode work split over `cores` processes running at once, no loader: what the cores
    do together (they share caches and memory bandwidth), the ceiling of any loader on them."""
    work = _floor_work(data)
    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        seconds, cpu = zip(*pool.map(_floor_share, [work[c::cores] for c in range(cores)]))
    return {"rate": len(work) / max(seconds), "cpu_ms": 1000 * sum(cpu) / len(work), "peak_mb": _peak_mb()}


def run_child(script: str, *argv: str) -> dict:
    """Run a benchmark script in a fresh process; what it prints as JSON on its last line."""
    out = subprocess.run([sys.executable, script, *argv], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def paired_rounds(child, rounds: int, also: tuple[str, ...] = ()) -> dict[str, list]:
    """Floor and loader runs (`child(method)`), alternating, each round also running the methods in
    `also` first: each method's runs by name, plus "ratios" (each round's loader rate over the floor
    run just before it) and "cpu_ratios" (the floor's CPU time per sample over the loader's, all its
    processes counted). The machine's speed wanders; pairs see it alike. On a busy machine the CPU
    ratio is the steadier: time waiting for a core counts in neither."""
    runs = [{method: child(method) for method in (*also, "floor", "loader")} for _ in range(rounds)]
    out = {method: [r[method] for r in runs] for method in (*also, "floor", "loader")}
    out["ratios"] = [r["loader"]["rate"] / r["floor"]["rate"] for r in runs]
    out["cpu_ratios"] = [r["floor"]["cpu_ms"] / r["loader"]["cpu_ms"] for r in runs]
    return out


def median_run(runs: list[dict]) -> dict:
    """The run of median rate."""
    return sorted(runs, key=lambda r: r["rate"])[len(runs) // 2]


def _child(method: str, data: pathlib.Path, args: argparse.Namespace) -> dict:
    return run_child(__file__, "--only", method, "--data", str(data), "--workers", str(args.workers),
                     "--epochs", str(args.epochs), "--naive-samples", str(args.naive_samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs of the loader (after one warm-up)")
    parser.add_argument("--naive-samples", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="floor and loader runs, alternating")
    parser.add_argument("--only", choices=["loader", "naive", "floor", "together", "sam", "jitter", "jitter-floor"])
    parser.add_argument("--sam", action="store_true", help="only the loader, with and without SAM_OPTIONS")
    parser.add_argument("--jitter", action="store_true",
                        help="only the loader with JITTER_OPTIONS, beside the kind's decode alone with them")
    parser.add_argument("--data", type=pathlib.Path)
    args = parser.parse_args()
    if args.only:
        run = {"loader": lambda: run_loader(args.data, args.workers, args.epochs),
               "naive": lambda: run_naive(args.data, args.workers, args.naive_samples),
               "floor": lambda: run_floor(args.data, args.workers),
               "together": lambda: run_floor_together(args.data, args.workers),
               "sam": lambda: run_loader(args.data, args.workers, args.epochs, **SAM_OPTIONS),
               "jitter": lambda: run_loader(args.data, args.workers, args.epochs, **JITTER_OPTIONS),
               "jitter-floor": lambda: run_kind_floor(args.data, args.workers, JITTER_OPTIONS)}[args.only]
        print(json.dumps(run()))
        return

    data = prepare(args.images)
    if args.sam:
        sam_cost(data, args)
        return
    if args.jitter:
        jitter_cost(data, args)
        return
    from pipeline.format import Manifest

    manifest = Manifest.from_json((data / "shards" / "manifest.json").read_bytes(), "m")
    print(f"data: {manifest.samples('train')} images 1500x2250 (portrait every third), "
          f"{sum(1 for _ in (data / 'files').glob('*.json'))} json files; settings {SETTINGS}, "
          f"num_workers={args.workers}, cores={os.cpu_count()}", flush=True)
    rounds = paired_rounds(lambda method: _child(method, data, args), args.rounds, also=("together",))
    floors, loaders, ratios, cpu_ratios = rounds["floor"], rounds["loader"], rounds["ratios"], rounds["cpu_ratios"]
    together = [loader["rate"] / run["rate"] for loader, run in zip(loaders, rounds["together"])]
    together_cpu = [run["cpu_ms"] / loader["cpu_ms"] for loader, run in zip(loaders, rounds["together"])]
    scaling = [run["rate"] / floor["rate"] for floor, run in zip(floors, rounds["together"])]
    results = {"floor": median_run(floors), "together": median_run(rounds["together"]), "loader": median_run(loaders),
               "naive": _child("naive", data, args)}
    floor, loader, naive = (results[m]["rate"] for m in ("floor", "loader", "naive"))
    print(f"{'method':<44}{'samples/s':>10}{'peak RSS MB (main / largest worker)':>40}{'tree MB':>9}")
    for method, label in (("floor", f"(c) floor: decode work only x {args.workers} cores"),
                          ("together", f"(c2) decode work only, {args.workers} processes at once"),
                          ("loader", "(a) make_stream_loader"), ("naive", "(b) naive: pycocotools decode all, sample")):
        own, children = results[method]["peak_mb"]
        tree = results[method].get("tree_mb", own)
        print(f"{label:<44}{results[method]['rate']:>10.1f}{own:>22.0f} / {children:<17.0f}{tree:>9.0f}")
    firsts = [r["cold_first_batch_s"] for r in loaders]
    print(f"floor per sample, one core: {results['floor']['per_sample_ms']:.1f} ms wall, {results['floor']['cpu_ms']:.1f} ms "
          f"CPU; loader: {results['loader']['cpu_ms']:.1f} ms CPU per sample (all its processes)")
    print(f"loader / floor = {statistics.median(ratios):.0%} by samples/s, {statistics.median(cpu_ratios):.0%} by CPU per "
          f"sample (target >= 90%; medians of {args.rounds} rounds, each the loader beside the floor run just before it: "
          f"{', '.join(f'{r:.0%}' for r in ratios)}; by CPU {', '.join(f'{r:.0%}' for r in cpu_ratios)}); "
          f"loader / naive = {loader / naive:.1f}x (target >= 20x)")
    print(f"the cores together: {args.workers} processes at once do {statistics.median(scaling):.0%} of {args.workers} x one "
          f"alone (rounds {', '.join(f'{r:.0%}' for r in scaling)}); loader / that = {statistics.median(together):.0%} by "
          f"samples/s, {statistics.median(together_cpu):.0%} by CPU per sample: what the loader's machinery costs")
    print(f"time to first batch from constructing the loader: {statistics.median(firsts):.2f} s (median of "
          f"{', '.join(f'{f:.2f}' for f in firsts)}); reference: one batch's decode work in one fresh process "
          f"{statistics.median(r['first_batch_s'] for r in floors):.2f} s, naive loader "
          f"{results['naive']['cold_first_batch_s']:.2f} s (target <= 0.32 s, the best peer's in issue 17)")
    print(f"peak memory of the process tree (VmHWM summed): loader {statistics.median(r['tree_mb'] for r in loaders):.0f} MB; "
          f"reference: naive loader, same DataLoader settings, {results['naive']['tree_mb']:.0f} MB (target <= 1.1 x "
          f"the best peer's 1080 MB in issue 17)")

def sam_cost(data: pathlib.Path, args: argparse.Namespace) -> None:
    """The loader with SAM_OPTIONS beside the loader without them, in alternating rounds (one run each)."""
    print(f"settings {SETTINGS}, num_workers={args.workers}, cores={os.cpu_count()}; SAM options {SAM_OPTIONS}",
          flush=True)
    runs = [{method: _child(method, data, args) for method in ("loader", "sam")} for _ in range(args.rounds)]
    ratios = [r["sam"]["rate"] / r["loader"]["rate"] for r in runs]
    cpu_ratios = [r["loader"]["cpu_ms"] / r["sam"]["cpu_ms"] for r in runs]
    for method, label in (("loader", "(a) make_stream_loader"), ("sam", "(a) with SAM options")):
        rates = [r[method]["rate"] for r in runs]
        cpu = [r[method]["cpu_ms"] for r in runs]
        print(f"{label:<28}{statistics.median(rates):>8.1f} samples/s (rounds {', '.join(f'{x:.1f}' for x in rates)}); "
              f"{statistics.median(cpu):.1f} ms CPU per sample")
    print(f"with / without = {statistics.median(ratios):.1%} by samples/s, {statistics.median(cpu_ratios):.1%} by CPU "
          f"per sample (target >= 95%; medians of {args.rounds} rounds: {', '.join(f'{r:.1%}' for r in ratios)}; "
          f"by CPU {', '.join(f'{r:.1%}' for r in cpu_ratios)})")


def jitter_cost(data: pathlib.Path, args: argparse.Namespace) -> None:
    """The loader with JITTER_OPTIONS beside the kind's decode alone with the same options and scales
    (`run_kind_floor`), in alternating rounds."""
    print(f"settings {SETTINGS}, num_workers={args.workers}, cores={os.cpu_count()}; {JITTER_OPTIONS}", flush=True)
    runs = [{method: _child(method, data, args) for method in ("jitter-floor", "jitter")} for _ in range(args.rounds)]
    for method, label in (("jitter-floor", "floor: the kind's decode alone"), ("jitter", "make_stream_loader")):
        rates, cpu = [r[method]["rate"] for r in runs], [r[method]["cpu_ms"] for r in runs]
        print(f"{label:<32}{statistics.median(rates):>8.1f} samples/s (rounds {', '.join(f'{x:.1f}' for x in rates)}); "
              f"{statistics.median(cpu):.1f} ms CPU per sample")
    ratios = [r["jitter"]["rate"] / r["jitter-floor"]["rate"] for r in runs]
    cpu_ratios = [r["jitter-floor"]["cpu_ms"] / r["jitter"]["cpu_ms"] for r in runs]
    print(f"loader / floor with the same scales = {statistics.median(ratios):.0%} by samples/s, "
          f"{statistics.median(cpu_ratios):.0%} by CPU per sample (rounds {', '.join(f'{r:.0%}' for r in ratios)})")


if __name__ == "__main__":
    main()
