"""Memory of `shard-pack index`'s duplicate check across archives at scale, beside a set of the keys.

    python bench/index_keys.py [--keys 100000000] [--per-archive 10000]

The indexer keeps, across archives, only what tells a key seen before (`shard_tools.index.SeenKeys`:
16 bytes a key) and each archive's rows in the manifest; an archive's own samples are written to
its index files and dropped as it comes. Synthetic SA-1B keys (`sa_<n>`), archive by archive, go
through `SeenKeys.add`; the reference is a set of the same key strings (what a naive indexer holds),
measured in the same run on the first `--reference` keys and scaled. Each in its own process:
figures are each process's peak RSS over its baseline (Linux).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(method: str, keys: int, per_archive: int) -> dict:
    from shard_tools.index import SeenKeys

    base, start = _peak_mb(), time.perf_counter()
    held = SeenKeys() if method == "seen-keys" else set()
    for first in range(0, keys, per_archive):
        archive = [f"sa_{n}" for n in range(first, min(first + per_archive, keys))]
        if method == "seen-keys":
            assert held.add(archive).all()
        else:
            held.update(archive)
    assert len(held) == keys
    return {"mb": _peak_mb() - base, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000_000)
    parser.add_argument("--per-archive", type=int, default=10_000, help="keys per archive (SA-1B: ~11,000)")
    parser.add_argument("--reference", type=int, default=10_000_000, help="keys in the set of strings")
    parser.add_argument("--only", choices=["seen-keys", "set"])
    args = parser.parse_args()
    if args.only:
        print(json.dumps(run(args.only, args.keys, args.per_archive)))
        return

    def child(method: str, keys: int) -> dict:
        argv = [sys.executable, __file__, "--only", method, "--keys", str(keys), "--per-archive", str(args.per_archive)]
        return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout.splitlines()[-1])

    ours, reference = child("seen-keys", args.keys), child("set", args.reference)
    scaled = reference["mb"] * args.keys / args.reference
    print(f"{args.keys:,} keys in archives of {args.per_archive:,}: SeenKeys {ours['mb']:,.0f} MB "
          f"({ours['mb'] * 2**20 / args.keys:.1f} bytes a key), {ours['seconds']:.0f} s; reference: a set of the key "
          f"strings, {reference['mb']:,.0f} MB at {args.reference:,} keys, {scaled:,.0f} MB scaled to {args.keys:,} "
          f"({scaled / ours['mb']:.1f}x)")


if __name__ == "__main__":
    main()
