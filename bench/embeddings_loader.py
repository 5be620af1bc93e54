"""Embeddings loader benchmark: make_stream_loader vs numpy gathers from memory-mapped .npy, one run.

    python bench/embeddings_loader.py [--rows 100000] [--workers 2] [--batch-size 1024]

Data (cached in .cache/bench-embeddings/): `question_emb` and `steering` (N, 768) float16,
`negative_embs` (N, 7, 768) float16, `cluster_id` int32 (a reference), `relevance` and
`centroid_distance` float32, `steering_variant` int8, a 95% train split; packed by shard-pack.
(a) make_stream_loader over the train split: num_workers=2, shuffled, batches of every field.
(b) floor: one single-threaded process gathering random batches of the same rows and fields with
    numpy fancy indexing from memory-mapped .npy files (page cache warm), times the cores.
(a0) the same loader with num_workers=0 (in the main process: no batch crosses processes).
(c) transport ceiling: a DataLoader with the same workers that reads nothing and only ships
    batches of the same bytes to the main process the way the loader does (recycled shared-memory
    buffers, `pipeline.collate.Leases`, filled by a copy): what process-based loading can reach here.
(c0) the same with a fresh shared-memory buffer per batch (the default way of torch's DataLoader).
Each runs in its own subprocess. Figures are medians over repeats (after a warm-up); compare
them as a ratio within one run, never across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import numpy as np

from sa1b_loader import median_run, paired_rounds, run_child, timed_epochs  # (bench/ is on the path of a script run from it)

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench-embeddings"
D, K = 768, 7
FIELDS = {  # name: (dtype, per-row shape, schema extras)
    "question_emb": ("float16", (D,), {}),
    "steering": ("float16", (D,), {}),
    "negative_embs": ("float16", (K, D), {}),
    "cluster_id": ("int32", (), {"index_into": 1024}),
    "relevance": ("float32", (), {"range": [0, 1]}),
    "centroid_distance": ("float32", (), {"range": [0, 2]}),
    "steering_variant": ("int8", (), {"range": [0, 3]}),
}


def prepare(rows: int) -> pathlib.Path:
    """Arrays, schema and packed shards for `rows` rows (cached)."""
    from shard_tools.embeddings import pack_embeddings
    from shard_tools.pack import PackOptions

    data = CACHE / str(rows)
    if (data / "shards" / "manifest.json").exists():
        return data
    print(f"building {rows} rows of D={D} float16 with K={K} negatives (cached in {data}) ...", flush=True)
    src = data / "src"
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, (dtype, shape, _) in FIELDS.items():
        out = np.lib.format.open_memmap(src / f"{name}.npy", mode="w+", dtype=dtype, shape=(rows, *shape))
        for start in range(0, rows, 8192):
            n = min(8192, rows - start)
            if dtype == "float16":
                out[start : start + n] = rng.standard_normal((n, *shape), dtype=np.float32)
            elif name == "cluster_id":
                out[start : start + n] = rng.integers(0, 1024, n)
            elif name == "steering_variant":
                out[start : start + n] = rng.integers(0, 4, n)
            else:
                out[start : start + n] = rng.random(n, dtype=np.float32) * (2 if name == "centroid_distance" else 1)
        out.flush()
        del out
    np.save(src / "train_idx.npy", np.sort(rng.permutation(rows)[: rows * 95 // 100]))
    schema = {"fields": {name: {"file": f"{name}.npy", **extra} for name, (_, _, extra) in FIELDS.items()},
              "splits": {"train": "train_idx.npy"}}
    (src / "schema.json").write_text(json.dumps(schema, indent=1))
    pack_embeddings(str(src), str(data / "shards"), options=PackOptions(splits=None, workers=2), progress=False)
    return data


def run_loader(data: pathlib.Path, workers: int, batch_size: int, epochs: int) -> dict:
    from pipeline import make_stream_loader

    loader = make_stream_loader(str(data / "shards"), "train", batch_size=batch_size, num_workers=workers)
    timed = timed_epochs(loader, epochs, "row")
    return {"rate": statistics.median(timed["rates"]), "rates": timed["rates"],
            "first_batch_s": statistics.median(timed["first"])}


def run_floor(data: pathlib.Path, batch_size: int, cores: int) -> dict:
    """One process's rate gathering random batches of train rows (every field) from memory-mapped .npy."""
    arrays = [np.load(data / "src" / f"{name}.npy", mmap_mode="r") for name in FIELDS]
    train = np.load(data / "src" / "train_idx.npy")
    rng = np.random.default_rng(1)
    rates = []
    for _ in range(4):  # the first pass warms the page cache and the mappings
        order = rng.permutation(train)
        start = time.perf_counter()
        n = 0
        for first in range(0, len(order) - batch_size + 1, batch_size):
            rows = order[first : first + batch_size]
            batch = [a[rows] for a in arrays]
            n += len(batch[0])
        rates.append(n / (time.perf_counter() - start))
    per_process = statistics.median(rates[1:])
    return {"rate": per_process * cores, "per_process": per_process}


def run_transport(data: pathlib.Path, workers: int, batch_size: int, epochs: int, recycle: bool) -> dict:
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    from pipeline.collate import Leases, empty
    from pipeline.format import Manifest

    manifest = Manifest.from_json((data / "shards" / "manifest.json").read_bytes(), "m")
    batches = manifest.splits["train"].units // batch_size
    nbytes = batch_size * (8 + sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for dtype, shape, _ in FIELDS.values()))

    class ShipOnly(IterableDataset):
        def __iter__(self):
            info = get_worker_info()
            source = np.ones(nbytes, np.uint8)
            for _ in range(info.id, batches, info.num_workers):
                if leases is None:
                    buffer = empty((nbytes,), torch.uint8)
                    buffer.numpy()[:] = source
                    yield {"buffer": buffer}
                    continue
                with leases.collating(info.id):
                    batch = {"buffer": empty((nbytes,), torch.uint8)}
                batch["buffer"].numpy()[:] = source
                leases.lend(info.id, batch)
                yield batch

    leases = Leases(workers) if recycle else None

    loader = DataLoader(ShipOnly(), batch_size=None, num_workers=workers, persistent_workers=True)
    rates = []
    for epoch in range(epochs + 1):
        start = time.perf_counter()
        n = sum(batch_size for _ in loader)
        if epoch:
            rates.append(n / (time.perf_counter() - start))
    return {"rate": statistics.median(rates)}


def _child(method: str, data: pathlib.Path, args: argparse.Namespace, workers: int | None = None) -> dict:
    workers = args.workers if workers is None else workers
    return run_child(__file__, "--only", method, "--data", str(data), "--workers", str(workers),
                     "--batch-size", str(args.batch_size), "--epochs", str(args.epochs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs of the loader (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="floor and loader runs, alternating")
    parser.add_argument("--only", choices=["loader", "floor", "transport", "fresh"])
    parser.add_argument("--data", type=pathlib.Path)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if args.only:
        run = {"loader": lambda: run_loader(args.data, args.workers, args.batch_size, args.epochs),
               "floor": lambda: run_floor(args.data, args.batch_size, cores),
               "transport": lambda: run_transport(args.data, args.workers, args.batch_size, args.epochs, True),
               "fresh": lambda: run_transport(args.data, args.workers, args.batch_size, args.epochs, False)}[args.only]
        print(json.dumps(run()))
        return

    data = prepare(args.rows)
    size = sum(p.stat().st_size for p in (data / "shards").glob("*.tar"))
    print(f"data: {args.rows} rows, D={D} float16, K={K} negatives + 4 scalar fields, 95% train; shards "
          f"{size / 1e9:.2f} GB; batch {args.batch_size}, num_workers={args.workers}, cores={cores}", flush=True)
    rounds = paired_rounds(lambda method: _child(method, data, args), args.rounds)
    floors, loaders, ratios = rounds["floor"], rounds["loader"], rounds["ratios"]
    floor, loader = median_run(floors), median_run(loaders)
    in_process = _child("loader", data, args, workers=0)
    transport = _child("transport", data, args)
    fresh = _child("fresh", data, args)
    print(f"{'method':<72}{'rows/s':>12}")
    for label, rate in ((f"(b) floor: numpy gathers from memory-mapped .npy, 1 process x {cores} cores", floor["rate"]),
                        (f"(a) make_stream_loader, num_workers={args.workers}", loader["rate"]),
                        ("(a0) make_stream_loader, num_workers=0", in_process["rate"]),
                        (f"(c) transport ceiling: {args.workers} workers only ship the same bytes", transport["rate"]),
                        ("(c0) the same, a fresh shared-memory buffer per batch", fresh["rate"])):
        print(f"{label:<72}{rate:>12,.0f}")
    print(f"floor per process: {floor['per_process']:,.0f} rows/s; loader epochs: "
          f"{', '.join(f'{r:,.0f}' for r in loader['rates'])} rows/s; time to first batch {loader['first_batch_s']:.2f} s")
    print(f"loader / floor = {statistics.median(ratios):.0%} (target >= 50%; median of {args.rounds} rounds, each the "
          f"loader beside the floor run just before it: {', '.join(f'{r:.0%}' for r in ratios)})")
    print(f"loader / transport ceiling = "
          f"{loader['rate'] / transport['rate']:.0%}; transport ceiling / floor = {transport['rate'] / floor['rate']:.0%}")


if __name__ == "__main__":
    main()
