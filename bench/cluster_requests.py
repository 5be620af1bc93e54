"""Cluster arithmetic: requests and egress of one epoch on a large job, from the loader's own plan.

    python bench/cluster_requests.py [--samples 11000000] [--shard-samples 1000] [--gpus 1000]
                                     [--rate 20] [--sample-bytes 1000000] [--nodes-simulated 2]
                                     [--shuffle shards-then-window]              (or: make bench-cluster)

No I/O: the plan (`plan_epoch`, the rank partition and the shuffle, `--shuffle`) is pure, so the
requests each way would send are counted from it, the same way the loader makes them:
  by range   each worker asks for its first batch alone, then chunks of as many batches as half of
             `read_ahead_bytes` holds after `read_amplification` (`schedule.Schedule._chunks`);
             a chunk's samples of one shard are merged into spans (`read.merge_spans`), one request
             each; each worker reads the index of each shard it touches; each rank the manifest
             (a HEAD and a GET)
  cache      per node: the manifest (a GET, and a HEAD per rank), then per shard any of its ranks
             touches one index and one download; each worker's first batch by range (none with
             `first_batch_by_range=False`: "first batch too")
The ranks of a node are consecutive (torchrun's order), so a node reads a contiguous stretch of the
epoch order. Samples are taken as `--sample-bytes` each (SA-1B: ~1 MB an image with its masks).
The whole-node figures are simulated for `--nodes-simulated` nodes spread over the job (their
mean); egress of the cache is counted for every node. GET/s are the epoch's requests over its
duration at `--rate` samples/s per GPU; S3 serves about 5,500 GET/s per prefix before it answers 503
SlowDown (AWS's figure; it adds partitions under sustained load, not within seconds).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pipeline.plan import World, plan_epoch
from pipeline.plan.shuffle import get_shuffle
from pipeline.read import merge_spans

S3_GETS_PER_PREFIX = 5500


def spans_of(ids: np.ndarray, per_shard: int, amplification: float) -> tuple[int, int]:
    """(requests, samples' worth of bytes read) for these sample ids read together: one request per
    merged span of each shard (samples of equal size)."""
    shards, within = np.divmod(ids, per_shard)
    count = read = 0
    for shard in np.unique(shards):
        ranges = [(int(i), int(i) + 1) for i in np.sort(within[shards == shard])]
        spans = merge_spans(ranges, amplification)
        count, read = count + len(spans), read + sum(end - start for start, end, _ in spans)
    return count, read


def worker_requests(sizes: list[int], world: World, args: argparse.Namespace) -> dict[str, object]:
    """One worker's epoch by range: requests (its first batch's apart), samples' worth read, shards touched."""
    plan = plan_epoch([sizes], 0, 0, world, batch_size=args.batch, window=args.window, shuffle=args.shuffle)
    most = max(1, int(args.read_ahead_bytes / (2 * args.amplification * args.batch * args.sample_bytes)))
    batches = [ids for _, _, ids in plan]
    first, read = spans_of(batches[0], args.shard_samples, args.amplification) if batches else (0, 0)
    requests = first
    for start in range(1, len(batches), most):
        more, bytes_ = spans_of(np.concatenate(batches[start : start + most]), args.shard_samples, args.amplification)
        requests, read = requests + more, read + bytes_
    touched = set(np.unique(np.concatenate(batches) // args.shard_samples).tolist()) if batches else set()
    return {"requests": requests, "first": first, "read": read, "touched": touched,
            "samples": sum(len(ids) for ids in batches),
            "shards a batch": sum(np.unique(ids // args.shard_samples).size for ids in batches)}


def node_requests(node: int, sizes: list[int], args: argparse.Namespace) -> dict[str, float]:
    """One node's epoch, each way: requests, samples, shards touched."""
    total = dict.fromkeys(("requests", "first", "read", "samples", "indexes", "shards a batch"), 0)
    node_shards: set[int] = set()
    for rank in range(node * args.gpus_per_node, (node + 1) * args.gpus_per_node):
        for worker in range(args.workers):
            found = worker_requests(sizes, World(rank, args.gpus, worker, args.workers), args)
            for key in ("requests", "first", "read", "samples", "shards a batch"):
                total[key] += found[key]  # type: ignore[operator]
            total["indexes"] += len(found["touched"])  # type: ignore[arg-type]
            node_shards |= found["touched"]  # type: ignore[operator]
    manifest = 2 * args.gpus_per_node  # a HEAD and a GET per rank
    return {"samples": total["samples"], "range": total["requests"] + total["indexes"] + manifest,
            "range read": total["read"] / total["samples"], "first": total["first"], "shards": len(node_shards),
            "shards a batch": total["shards a batch"] * args.batch / total["samples"],
            "cache": 1 + args.gpus_per_node + 2 * len(node_shards) + total["first"],
            "cache, first batch too": 1 + args.gpus_per_node + 2 * len(node_shards)}


def cache_egress(sizes: list[int], args: argparse.Namespace) -> float:
    """Shards downloaded by all nodes together over the shards of the dataset (each node downloads
    every shard its ranks touch, whole)."""
    nodes = args.gpus // args.gpus_per_node
    per_rank = len(sizes) * args.shard_samples // (args.gpus * args.batch) * args.batch  # (drop_last spans)
    order = get_shuffle(args.shuffle)(sizes, [0, 0], args.window)
    downloads = 0
    for node in range(nodes):
        positions = np.arange(node * args.gpus_per_node * per_rank, (node + 1) * args.gpus_per_node * per_rank)
        downloads += np.unique(order(positions) // args.shard_samples).size
    return downloads / len(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=11_000_000)
    parser.add_argument("--shard-samples", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rate", type=float, default=20.0, help="samples/s per GPU")
    parser.add_argument("--sample-bytes", type=float, default=1e6)
    parser.add_argument("--window", type=int, default=16384)
    parser.add_argument("--shuffle", default="shards-then-window", help="a name in pipeline.plan.SHUFFLES")
    parser.add_argument("--read-ahead-bytes", type=int, default=256 << 20)
    parser.add_argument("--amplification", type=float, default=2.0)
    parser.add_argument("--nodes-simulated", type=int, default=2)
    args = parser.parse_args()
    if args.gpus % args.gpus_per_node:
        sys.exit("--gpus must be a multiple of --gpus-per-node")

    start = time.perf_counter()
    sizes = [args.shard_samples] * (args.samples // args.shard_samples)
    nodes = args.gpus // args.gpus_per_node
    picked = np.linspace(0, nodes - 1, args.nodes_simulated).round().astype(int).tolist()
    found = [node_requests(node, sizes, args) for node in picked]
    mean = {key: float(np.mean([f[key] for f in found])) for key in found[0]}
    seconds = args.samples / (args.gpus * args.rate)
    egress = cache_egress(sizes, args)
    dataset = args.samples * args.sample_bytes
    shard_gib = args.shard_samples * args.sample_bytes / 2**30
    print(f"{args.samples:,} samples of {args.sample_bytes / 1e6:.1f} MB in shards of {args.shard_samples} "
          f"({shard_gib:.2f} GiB); {args.gpus} GPUs, {args.gpus_per_node} a node, {args.workers} workers a rank, "
          f"batch {args.batch}, {args.rate:g} samples/s a GPU: an epoch is {seconds:.0f} s")
    print(f"a node (mean of nodes {picked}): {mean['samples']:,.0f} samples from {mean['shards']:,.0f} shards; "
          f"shuffle {args.shuffle!r}: {mean['shards a batch']:.2f} shards a batch")
    for way in ("range", "cache", "cache, first batch too"):
        per_sample = mean[way] / mean["samples"]
        rate = per_sample * args.samples / seconds
        print(f"  {way:<22} {mean[way]:>9,.0f} requests a node per epoch, {per_sample:.4f} a sample; the job: "
              f"{rate:>8,.0f} GET/s ({rate / S3_GETS_PER_PREFIX:.2f}x the ~{S3_GETS_PER_PREFIX:,} of one prefix)")
    print(f"  first batches: {mean['first']:,.0f} requests a node at the epoch's start; "
          f"{mean['first'] * nodes:,.0f} for the job within its first seconds")
    used, read = mean["samples"] * nodes * args.sample_bytes, mean["range read"]
    print(f"egress per epoch: by range {read:.2f}x the samples used ({read * used / 1e12:.1f} TB), the cache "
          f"{egress:.2f}x the dataset ({egress * dataset / 1e12:.1f} TB: every shard a node touches, whole)")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
