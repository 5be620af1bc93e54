"""Distillation benchmark: SA-1B with a 2 MiB float16 teacher output per sample (256 x 64 x 64, ViT-H's
image embedding), written by `pipeline.OutputWriter` and attached at load time (`attach=`).

    python bench/distill.py [--images 256] [--workers 2] [--rounds 3]     (or: make bench-distill)

The images of `bench/sa1b_loader.py` (1500x2250, 32 a shard), the loader as there (batch 8, image
1024, masks 256, max 64, num_workers=2). Each figure beside its reference from the same run, in
interleaved rounds, each measurement in a fresh subprocess (its process tree's peak memory its own);
medians over the rounds:
(a) write: a loop over a cheap loader of the split (image 64, one mask: the loop's own work small)
    writing each sample's 2 MiB (as a teacher would hand it over, already computed) into a local
    sidecar, less the same loop without writes, against a plain sequential write of the same bytes
    to the same disk (one file, synced at the end). Target: the writer at >= 0.8 of the plain write.
(b) joined, local: samples/s, CPU ms per sample (all of the loader's processes) and the process
    tree's peak memory of the loader with the sidecar attached, against SA-1B alone. Target >= 0.9.
(c) joined, through the shard cache from a local S3 server (SeaweedFS on 127.0.0.1, sharing the
    cores; the dataset and the sidecar uploaded, the cache emptied before each epoch), against (b).
    Target >= 0.85. Beside it SA-1B alone the same way: what the cache path itself costs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from sa1b_loader import SETTINGS, measured, packed  # noqa: E402

EMBEDDING = (256, 64, 64)  # float16: 2 MiB a sample
CHEAP = dict(batch_size=8, image_size=64, mask_size=16, max_masks=1)


def _outputs(batch_size: int):
    import torch

    return torch.randn(batch_size, *EMBEDDING, generator=torch.Generator().manual_seed(0)).half()


def write_loop(shards: str, out: str | None, workers: int, settings: dict) -> float:
    """Seconds of one loop over the split, writing each batch's outputs into `out` (None: no writes)."""
    from pipeline import OutputWriter, make_stream_loader

    outputs = _outputs(settings["batch_size"])
    start = time.perf_counter()  # (the workers' start is in both loops alike)
    loader = make_stream_loader(shards, "train", num_workers=workers, drop_last=False, **settings)
    if out is None:
        for batch in loader:
            assert len(batch["keys"]) == len(outputs)
    else:
        with OutputWriter(out, loader, inputs=("images",)) as writer:
            for batch in loader:
                writer.write(batch["keys"], {"teacher": outputs[: len(batch["keys"])]})
    return time.perf_counter() - start


def plain_write(path: str, samples: int) -> float:
    """Seconds to write `samples` outputs' bytes to one file, sequentially, synced at the end."""
    data = _outputs(1).numpy().tobytes()
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(samples):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def joined(source: str, workers: int, epochs: int, **options) -> dict:
    from pipeline import make_stream_loader

    return measured(lambda: make_stream_loader(source, "train", num_workers=workers, **SETTINGS, **options), epochs)


def _one(args: argparse.Namespace) -> None:
    """A measurement in this subprocess, printed as JSON."""
    spec = json.loads(args.one)
    if spec["what"] == "write":
        result = {"s": write_loop(spec["shards"], spec.get("out"), args.workers, CHEAP)}
    elif spec["what"] == "plain":
        result = {"s": plain_write(spec["out"], spec["samples"])}
    else:
        if spec.get("cache"):
            shutil.rmtree(spec["cache"]["cache_dir"], ignore_errors=True)
        result = joined(spec["source"], args.workers, args.epochs, **spec.get("options", {}), **spec.get("cache", {}))
    print(json.dumps(result))


def _run(args: argparse.Namespace, spec: dict) -> dict:
    os.sync()  # (no run pays for the dirty pages of the one before: the cache's downloads, a write)
    found = subprocess.run([sys.executable, __file__, "--workers", str(args.workers), "--epochs", str(args.epochs),
                            "--one", json.dumps(spec)], capture_output=True, text=True, check=False)
    if found.returncode:
        raise SystemExit(f"{spec['what']} failed:\n{found.stderr}")
    return json.loads(found.stdout.strip().splitlines()[-1])


def _teacher_pass(shards: str, out: str, workers: int) -> None:
    """The sidecar the joined loaders attach: every sample's 2 MiB, written by a loader of `SETTINGS`."""
    from pipeline import OutputWriter, make_stream_loader

    if pathlib.Path(out, "outputs.json").exists():
        return
    print(f"writing the teacher's sidecar ({out}) ...", flush=True)
    loader = make_stream_loader(shards, "train", num_workers=workers, drop_last=False, **SETTINGS)
    outputs = _outputs(SETTINGS["batch_size"])
    with OutputWriter(out, loader, inputs=("images",)) as writer:
        for batch in loader:
            writer.write(batch["keys"], {"teacher": outputs[: len(batch["keys"])]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per joined measurement (after one)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return _one(args)

    from shard_tools.samples import locals3

    shards = packed(args.images, 32)
    sidecar = str(shards.parent / "sidecar-vith")
    _teacher_pass(str(shards), sidecar, args.workers)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-distill-"))
    weed = locals3.SeaweedFS(work / "seaweedfs")
    weed.start()
    try:
        options = locals3.storage_options(weed.endpoint)
        from pipeline.storage import filesystem

        fs, _ = filesystem("s3://bench", options)
        fs.mkdir("bench")
        fs.put(str(shards) + "/", "bench/sa1b/", recursive=True)
        fs.put(sidecar + "/", "bench/sidecar/", recursive=True)
        size = sum(p.stat().st_size for p in pathlib.Path(sidecar).rglob("*.tar")) + \
            sum(p.stat().st_size for p in shards.glob("*.tar"))
        cache = {"cache_dir": str(work / "cache"), "cache_limit": 2 * size}
        from pipeline.storage import read_manifest

        samples = int(read_manifest(str(shards)).splits["train"].sample_counts.sum())
        runs: dict[str, list[dict]] = {k: [] for k in ("write", "loop", "plain", "alone", "joined", "s3 alone",
                                                       "s3 joined")}
        for round_ in range(args.rounds):
            print(f"round {round_ + 1} of {args.rounds} ...", flush=True)
            out = str(work / "written")
            shutil.rmtree(out, ignore_errors=True)
            runs["loop"].append(_run(args, {"what": "write", "shards": str(shards)}))
            runs["write"].append(_run(args, {"what": "write", "shards": str(shards), "out": out}))
            shutil.rmtree(out, ignore_errors=True)
            runs["plain"].append(_run(args, {"what": "plain", "out": str(work / "plain.bin"), "samples": samples}))
            os.unlink(work / "plain.bin")
            runs["alone"].append(_run(args, {"what": "joined", "source": str(shards)}))
            runs["joined"].append(_run(args, {"what": "joined", "source": str(shards),
                                              "options": {"attach": {"teacher": sidecar}}}))
            runs["s3 alone"].append(_run(args, {"what": "joined", "source": "s3://bench/sa1b", "cache": cache,
                                                 "options": {"storage_options": options}}))
            runs["s3 joined"].append(_run(args, {
                "what": "joined", "source": "s3://bench/sa1b", "cache": cache,
                "options": {"storage_options": options, "attach": {"teacher": "s3://bench/sidecar"}}}))
        report(runs, samples, args)
    finally:
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(runs: dict[str, list[dict]], samples: int, args: argparse.Namespace) -> None:
    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    mib = samples * 2
    writer = median("write", "s") - median("loop", "s")
    plain = median("plain", "s")
    print(f"\n{args.images} SA-1B images at 1500x2250, 32 a shard; {SETTINGS}, num_workers={args.workers}; "
          f"teacher output float16 {list(EMBEDDING)} (2 MiB) a sample; medians of {args.rounds} rounds")
    print(f"(a) write {mib} MiB: writer {writer:.2f} s ({mib / writer:.0f} MiB/s: the loop with writes "
          f"{median('write', 's'):.2f} s less the loop alone {median('loop', 's'):.2f} s), plain sequential write "
          f"{plain:.2f} s ({mib / plain:.0f} MiB/s): {plain / writer:.2f} of the plain write (target >= 0.8)")
    alone, local = median("alone", "rate"), median("joined", "rate")
    print(f"{'loader':<12}{'samples/s':>10}{'x ref':>8}{'CPU ms/smp':>12}{'tree MB':>9}")
    for name, ref in (("alone", alone), ("joined", alone), ("s3 alone", alone), ("s3 joined", local)):
        print(f"{name:<12}{median(name, 'rate'):>10.1f}{median(name, 'rate') / ref:>8.2f}"
              f"{median(name, 'cpu_ms'):>12.1f}{median(name, 'tree_mb'):>9.0f}")
    print(f"targets: joined >= 0.9 x alone ({local / alone:.2f}); s3 joined through the cache >= 0.85 x joined "
          f"({median('s3 joined', 'rate') / local:.2f}); write >= 0.8 x plain ({plain / writer:.2f})")


if __name__ == "__main__":
    main()
