"""SA-1B loader over the original archives indexed in place (`shard-pack index sa1b`) against the
same images packed (`shard-pack sa1b`), with `make bench`'s settings (batch 8, 2 workers, image 1024,
masks 256, max 64), and what reading the originals' JSON costs per sample.

    python bench/inplace_loader.py [--images 128] [--rounds 5] [--epochs 2]

Each round runs the packed loader then the originals' loader, each in a fresh process (one warm-up
epoch, then `--epochs` timed); the ratio of each round's pair is printed, and their median, by
samples/s and by CPU time per sample of all the loader's processes (steadier on a busy machine).
Compare them as ratios within one run, never across machines.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tarfile
import time

from sa1b_loader import SETTINGS, packed_samples, prepare, run_child, timed_epochs

DATASETS = {"packed": "shards", "originals": "indexed"}


def run_loader(root: pathlib.Path, workers: int, epochs: int) -> dict:
    from pipeline import make_stream_loader

    # (the originals are outside the indexed dataset's folder: named as a root the loader may read)
    loader = make_stream_loader(str(root), "train", num_workers=workers, allowed_roots=[str(root.parent / "src")],
                                **SETTINGS)
    timed = timed_epochs(loader, epochs, "keys")
    return {"rate": statistics.median(timed["rates"]), "cpu_ms": timed["cpu_ms"]}


def json_costs(data: pathlib.Path) -> dict:
    """CPU time per sample, in one process on bytes in memory (median of 5 passes): parsing the JSON within its
    limits, the whole original record (parsing and checks), and the whole decode of an original and
    of the same image packed."""
    import torch

    from pipeline.format import parse_json
    from pipeline.kinds.sa1b import Sa1b, Sa1bOptions, original_record

    torch.set_num_threads(1)  # (as in a DataLoader worker)
    samples = []
    for archive in sorted((data / "src").glob("*.tar")):
        with tarfile.open(archive) as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        samples += [(name[:-4], {"jpg": files[name], "json": files[name[:-4] + ".json"]})
                    for name in sorted(files) if name.endswith(".jpg")]
    packed = dict(packed_samples(data / "shards"))
    kind = Sa1b(Sa1bOptions(**{k: v for k, v in SETTINGS.items() if k != "batch_size"}))
    steps = {"parse_json": lambda key, m: parse_json(m["json"]),
             "original_record": lambda key, m: original_record(m, "bench", key),
             "decode_sample": lambda key, m: kind.decode(m, seed=0, epoch=0, url="bench", key=key),
             "decode_packed": lambda key, m: kind.decode(packed[key], seed=0, epoch=0, url="bench", key=key)}
    passes: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(5):  # (the steps alternate: the machine's speed wanders)
        for name, step in steps.items():
            start = time.process_time()
            for key, members in samples:
                step(key, members)
            passes[name].append((time.process_time() - start) / len(samples) * 1000)
    costs = {f"{name}_ms": statistics.median(values) for name, values in passes.items()}
    costs["json_bytes"] = statistics.median(len(m["json"]) for _, m in samples)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=5, help="packed and originals runs, alternating")
    parser.add_argument("--only", choices=[*DATASETS, "json"])
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.only == "json":
        print(json.dumps(json_costs(pathlib.Path(args.data))))
        return
    if args.only:
        print(json.dumps(run_loader(pathlib.Path(args.data) / DATASETS[args.only], args.workers, args.epochs)))
        return
    data = prepare(args.images)
    if not (data / "indexed" / "manifest.json").exists():
        from shard_tools.index import index_sa1b

        index_sa1b([str(data / "src")], str(data / "indexed"), progress=False)

    def child(only: str) -> dict:
        return run_child(__file__, "--only", only, "--data", str(data), "--workers", str(args.workers),
                         "--epochs", str(args.epochs))

    runs = [(child("packed"), child("originals")) for _ in range(args.rounds)]
    pairs = [(packed["rate"], originals["rate"]) for packed, originals in runs]
    ratios = [originals / packed for packed, originals in pairs]
    cpu_ratios = [packed["cpu_ms"] / originals["cpu_ms"] for packed, originals in runs]
    costs = child("json")
    print(f"{args.images} images (1500x2250, ~{costs['json_bytes'] / 1e3:.0f} kB of JSON each), batch "
          f"{SETTINGS['batch_size']}, {args.workers} workers, {args.rounds} rounds of {args.epochs} timed epochs")
    print(f"  packed     {statistics.median(p for p, _ in pairs):6.1f} samples/s  (runs: "
          f"{', '.join(f'{p:.1f}' for p, _ in pairs)})")
    print(f"  originals  {statistics.median(o for _, o in pairs):6.1f} samples/s  (runs: "
          f"{', '.join(f'{o:.1f}' for _, o in pairs)})")
    print(f"  originals / packed, median of the rounds' ratios: {statistics.median(ratios):.2f}  (rounds: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"  by CPU time per sample of all processes (steadier on a busy machine), packed / originals: "
          f"{statistics.median(cpu_ratios):.2f}  (rounds: {', '.join(f'{r:.2f}' for r in cpu_ratios)})")
    print(f"  per sample, one core: parse_json {costs['parse_json_ms']:.2f} ms, the whole record (parse + checks) "
          f"{costs['original_record_ms']:.2f} ms, of a whole decode {costs['decode_sample_ms']:.1f} ms (the same image "
          f"packed: {costs['decode_packed_ms']:.1f} ms, ratio {costs['decode_packed_ms'] / costs['decode_sample_ms']:.2f})")


if __name__ == "__main__":
    sys.exit(main())
