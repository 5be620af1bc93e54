"""CPU per range request of the two s3:// clients: s3fs (aiobotocore), and the lean client (obstore).

    python bench/s3_client.py [--requests 500] [--rounds 3] [--object-mib 64]

One object of random bytes on a SeaweedFS server started for the run (`weed mini`, loopback only,
explicit credentials). Each way reads `--requests` ranges at random offsets (the same offsets for
both), one after another, through `Ranged.read` as `ShardReader` calls it (pieces, retries, length
check), with the client s3fs or the lean one; "size" is as many HEAD requests (`Ranged.size`).
The ways take turns in each round, so that load on the machine hits them alike. Figures: this
process's CPU time (user + system, all its threads) per request, and wall time per request,
medians over the rounds; the server runs in another process and is not counted.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from shard_tools.samples.locals3 import AWS_ENV, SeaweedFS, storage_options  # noqa: E402

# Explicit credentials only: no cloud metadata probing, no user configuration files.
os.environ.update({k: v for k, v in AWS_ENV.items() if not k.startswith(("AWS_ACCESS", "AWS_SECRET"))})

SIZES = {"64 KiB": 64 << 10, "1 MiB": 1 << 20}


def measure(read, calls: list[tuple[int, int]]) -> tuple[float, float]:
    """(CPU ms, wall ms) per call of `read(start, end)` over `calls`."""
    cpu, wall = time.process_time(), time.perf_counter()
    for start, end in calls:
        read(start, end)
    n = len(calls)
    return (time.process_time() - cpu) * 1e3 / n, (time.perf_counter() - wall) * 1e3 / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--object-mib", type=int, default=64)
    args = parser.parse_args(argv)

    import s3fs

    from pipeline.storage import Retry, filesystem
    from pipeline.storage.ranged import Ranged, ranged_reader

    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedFS(pathlib.Path(tmp) / "seaweedfs")
        server.start()
        try:
            options = storage_options(server.endpoint)
            size = args.object_mib << 20
            s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir("bench")
            s3fs.S3FileSystem(**options, skip_instance_cache=True).pipe_file("bench/object", os.urandom(size))
            url, retry = "s3://bench/object", Retry()
            fs, path = filesystem(url, options)
            clients = {"s3fs": Ranged(fs, path, url, retry), "lean": ranged_reader(url, options, retry)}
            assert type(clients["lean"].client).__name__ == "S3Client", clients["lean"]
            rng = random.Random(0)
            ways = {name: [(start, start + length) for start in (rng.randrange(0, size - length)
                                                                for _ in range(args.requests))]
                    for name, length in SIZES.items()}
            ways["size"] = [(0, 0)] * args.requests
            for client in clients.values():  # connections opened, clients made
                client.read(0, 1 << 16), client.size()
            results: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for round_ in range(args.rounds):
                for way, calls in ways.items():
                    for name, client in (clients.items() if round_ % 2 == 0 else reversed(clients.items())):
                        read = (lambda s, e, c=client: c.size()) if way == "size" else client.read
                        results.setdefault((way, name), []).append(measure(read, calls))
        finally:
            server.stop()

    print(f"CPU and wall time per request, {args.requests} requests per way, medians of {args.rounds} rounds "
          f"(SeaweedFS on 127.0.0.1; this process only)")
    print(f"{'request':<14} {'s3fs CPU ms':>12} {'lean CPU ms':>12} {'CPU ratio':>10} {'s3fs wall ms':>13} "
          f"{'lean wall ms':>13}")
    for way in ways:
        (old_cpu, old_wall), (new_cpu, new_wall) = (
            tuple(statistics.median(r[i] for r in results[(way, name)]) for i in (0, 1)) for name in ("s3fs", "lean"))
        label = f"{way} range" if way != "size" else "size HEAD"
        print(f"{label:<14} {old_cpu:>12.3f} {new_cpu:>12.3f} {old_cpu / new_cpu:>9.1f}x {old_wall:>13.3f} "
              f"{new_wall:>13.3f}")
    for (way, name), rounds in results.items():
        print(f"  {way:<7} {name:<5} CPU ms per round: {', '.join(f'{cpu:.3f}' for cpu, _ in rounds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
