"""The `shard-pack` pieces that `shard_tools.cli` and each kind's subcommand share: the flags several
subcommands take, each set a parent parser defined once here; what a subcommand is (`Command`); and
what a packing subcommand's run does with its flags (`pack_options`) and its result (`summary`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from shard_tools.pack import PackOptions

__all__ = ["Command", "OUT", "Subparsers", "allow", "boolean", "fractions", "images", "int_or_none", "pack_options",
           "pair", "quiet", "shards", "size", "storage", "storage_options", "summary", "workers"]

log = logging.getLogger("shard-pack")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
Subparsers = argparse._SubParsersAction
OUT = "output folder (new or empty, or an interrupted pack of the same input)"


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: `add(subparsers, name)` adds its parser; `run(args)` does it and returns the exit code."""

    add: Callable[[Subparsers, str], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], int]


def size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 500MB, 1GiB or a number of bytes")
    return int(float(match[1]) * _UNITS[match[2] or ""])


def storage_options(text: str) -> dict[str, Any]:
    """`--storage-options`: a JSON object, given as it is or as `@FILE`. Messages never echo it (it may
    hold credentials)."""
    if text.startswith("@"):
        try:
            text = pathlib.Path(text[1:]).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]!r}: {reason}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg} at character {exc.pos}): want a JSON object of "
                                         """fsspec options, e.g. '{"anon": true}', or @FILE holding one""") from None
    if not isinstance(value, dict):
        what = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise argparse.ArgumentTypeError(f"want a JSON object of fsspec options (name: value), e.g. "
                                         f"""'{{"anon": true}}', not {what}""")
    return value


def int_or_none(text: str) -> int | None:
    try:
        return None if text.lower() == "none" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: want an integer or 'none'") from None


def boolean(text: str) -> bool:
    """`true`/`false` (also yes/no, 1/0): a loader option that is True or False."""
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: want true or false")
    return value


def pair(text: str) -> tuple[float, float]:
    """`LO,HI`: two numbers (a range such as scale_jitter's)."""
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid range {text!r}: want two numbers LO,HI, e.g. 0.1,2.0") from None
    return lo, hi


# -- flags several subcommands share, each set defined once as a parent parser ----------------------

def quiet(default: Any = argparse.SUPPRESS, text: str = "no progress bar or lines") -> argparse.ArgumentParser:
    """`-q`, before the subcommand (default False) or after it (SUPPRESS: a -q given before stays set)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-q", "--quiet", action="store_true", default=default, help=text)
    return parser


def storage() -> argparse.ArgumentParser:
    """`--storage-options`: every subcommand that reads or writes by URL."""
    parser = argparse.ArgumentParser(add_help=False)
    example = """'{"client_kwargs": {"endpoint_url": "https://s3.example.com"}}'"""
    parser.add_argument("--storage-options", type=storage_options, metavar="JSON", help="fsspec's options for "
                        "the URLs read and written, as make_stream_loader's storage_options: a JSON object, "
                        f"e.g. {example}, or @FILE holding one (credentials stay off the command line); "
                        "default: the environment's (AWS_*)")
    return parser


def allow() -> argparse.ArgumentParser:
    """`--allow-root`: every subcommand that reads a dataset's shards."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--allow-root", dest="allowed_roots", action="append", default=[], metavar="ROOT",
                        help="a folder or URL outside the dataset's folder that its manifest may name (archives "
                        "indexed in place elsewhere; make_stream_loader's allowed_roots); repeat for several")
    return parser


def shards(items: str, data: str = "input") -> argparse.ArgumentParser:
    """`--shard-samples`, `--shard-bytes`: when a shard is full (every packing subcommand)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--shard-samples", type=int, default=1000, help=f"at most this many {items} per shard (1000)")
    parser.add_argument("--shard-bytes", type=size, default="1GiB", help=f"at most this much {data} per shard (1GiB)")
    return parser


def fractions(how: str = "") -> argparse.ArgumentParser:
    """`--split`: split fractions by key hash (packing kinds that split by key, `index`)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--split", default="train=1",
                        help=f"split fractions by key hash{how}, e.g. train=0.99,val=0.01")
    return parser


def images(max_side: str) -> argparse.ArgumentParser:
    """`--image-max-side`, `--jpeg-quality`: re-encoding images (packing kinds that store images)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--image-max-side", type=int, help=max_side)
    parser.add_argument("--jpeg-quality", type=int, default=90, help="quality of re-encoded JPEGs (90)")
    return parser


def workers(what: str = "processes", skipped: str | None = "input samples", *, dask: str) -> argparse.ArgumentParser:
    """`--workers`, `--max-skipped` (where `skipped` names the inputs), `--dask` (`dask`: its help):
    where the work runs, and how many bad inputs end it (packing and `index`)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help=f"{what} (all cores)")
    if skipped:
        parser.add_argument("--max-skipped", type=int, default=10, help=f"fail when more {skipped} are bad (10)")
    parser.add_argument("--dask", metavar="ADDRESS", help=dask)
    return parser


# -- what a packing subcommand's run shares -------------------------------------------------------

def pack_options(args: argparse.Namespace, *, splits: Sequence[tuple[str, float]] | None,
                 max_skipped: int) -> PackOptions:
    """The `PackOptions` of a packing subcommand's shared flags (`shards`, `workers`, `storage`)."""
    return PackOptions(shard_samples=args.shard_samples, shard_bytes=args.shard_bytes, splits=splits,
                       workers=args.workers, max_skipped=max_skipped, dask=args.dask,
                       storage_options=args.storage_options)


def summary(done: Any) -> int:
    """Prints a pack's or an index run's summary (a `PackSummary` or `IndexSummary`), after its first
    skipped inputs (logged)."""
    for skip in done.skip_list[:20]:
        log.warning("skipped %s", skip["reason"])
    print("\n".join(done.lines()))
    return 0
