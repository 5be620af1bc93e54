"""Before and after a change, in paired rounds on one machine: a benchmark script run alternately
from a base revision and from this checkout, so that load on the machine hits both alike.

    python bench/paired.py --base REV [--rounds 3] [--show REGEX] -- bench/sa1b_loader.py --images 256

The base revision is checked out once into .cache/paired/REV (a git worktree) and run with its own
`pipeline` and `shard_tools` first on the path; both share this checkout's .cache (the benchmarks'
data, built once). Each run's output is kept in .cache/paired/logs/; the lines matching --show
(all of them by default) are printed per round, base first. Compare the figures each script prints
against its own reference (a ratio within one run), round by round.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def checkout(base: str) -> pathlib.Path:
    """A worktree of revision `base` (made once), sharing this checkout's .cache."""
    commit = subprocess.run(["git", "rev-parse", "--short", base], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    tree = ROOT / ".cache" / "paired" / commit
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True)
        (tree / ".cache").symlink_to(ROOT / ".cache")
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare with (a commit, tag or branch)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--show", default="", help="print only the output lines matching this regular expression")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- the benchmark script and its arguments")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the benchmark script after --")
    base = checkout(args.base)
    logs = ROOT / ".cache" / "paired" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    show = re.compile(args.show)
    for round_ in range(1, args.rounds + 1):
        for name, tree in (("base", base), ("this", ROOT)):
            env = {**os.environ, "PYTHONPATH": str(tree)}
            run = subprocess.run([sys.executable, str(tree / script[0]), *script[1:]], cwd=tree, env=env,
                                 capture_output=True, text=True)
            log = logs / f"{pathlib.Path(script[0]).stem}-{round_}-{name}.txt"
            log.write_text(run.stdout + run.stderr)
            print(f"== round {round_}, {name} ({tree}), exit {run.returncode}, log {log}", flush=True)
            for line in run.stdout.splitlines():
                if show.search(line):
                    print("   ", line, flush=True)
            if run.returncode:
                print(run.stderr[-2000:], file=sys.stderr)
                return run.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
