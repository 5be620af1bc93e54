"""`shard-pack`: pack datasets into shards (a subcommand per packing kind), index original archives
in place (`index KIND`), read them back (`inspect`, `verify`; also a sidecar of outputs, written by
`pipeline.OutputWriter`), link an embeddings dataset's vectors to another's samples by key
(`link`), measure and draw them as the loader reads them (`tune`, `preview`), and bring older
datasets to the current schema (`upgrade`). The kinds' subcommands and flags come from the registry
(`shard_tools.kinds`); the flags several subcommands share are parent parsers in `shard_tools.flags`.

Exit codes: 0 done; 1 the data has problems (no sample to pack or index, too many skipped inputs,
an input that is not what it says: a `.tar` that is not a tar archive, annotations that are not
JSON, embeddings input that fails its checks; `verify` findings); 2 the command cannot run as asked
(bad arguments, a missing input, an output folder holding something else); 3 the run failed on its
environment (disk full, an I/O error, a worker process killed; for `tune`, a measuring process that
failed): the finished shards are kept, and the same command run again finishes the pack; 130
interrupted (Ctrl-C): a pack's finished shards are kept and the same command resumes it. A command
refused, or ended before it finished a shard, leaves nothing behind.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import pathlib
import sys
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pipeline.errors import ConfigError, InputError, ShardstreamError
from pipeline.storage import read_manifest
from shard_tools.flags import Command, Subparsers, allow, fractions, quiet, storage, summary, workers
from shard_tools.index import index_archives
from shard_tools.kinds import KINDS, KindOption
from shard_tools.link import add_link, run_link
from shard_tools.outputs import describe_sidecar, is_sidecar, verify_sidecar
from shard_tools.pack import TooManySkipped, parse_splits
from shard_tools.preview import preview, write_png
from shard_tools.tune import WITHIN, TuneError, default_workers, plot, tune
from shard_tools.verify import describe, upgrade, verify

__all__ = ["COMMANDS", "EXITS", "Command", "main"]

log = logging.getLogger("shard-pack")
_PACKING = [name for name, kind in KINDS.items() if kind.add is not None]  # a subcommand each, in this order
_INDEXED = {name: kind.index for name, kind in KINDS.items() if kind.index is not None}  # `index NAME` each
_DASK = "run the shard tasks on a Dask cluster"
_ADDRESSES = "tcp://scheduler:8786, or local:N"


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: want integers separated by commas, "
                                         "e.g. 0,2,4") from None


def _kind_options() -> argparse.ArgumentParser:
    """The loader's kind options (`tune`, `preview`), as the kinds declare them; only those given are
    passed on. A flag several kinds take is one flag: the first kind's type and choices, their helps
    joined."""
    merged: dict[str, list[KindOption]] = {}
    for kind in KINDS.values():
        for option in kind.options:
            merged.setdefault(option.flag, []).append(option)
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("kind options (as make_stream_loader's; default: the loader's)")
    for flag, (first, *more) in merged.items():
        extra = {"type": first.type} if first.type is not None else {}
        extra |= {"choices": list(first.choices)} if first.choices is not None else {}
        group.add_argument(flag, default=argparse.SUPPRESS, help=", ".join(o.help for o in (first, *more)), **extra)
    return parser


_KIND_OPTIONS = tuple(dict.fromkeys(option.dest for kind in KINDS.values() for option in kind.options))


def _kind(args: argparse.Namespace) -> dict[str, Any]:
    """The kind options given on the command line (one not given is absent: its default is SUPPRESS)."""
    return {name: getattr(args, name) for name in _KIND_OPTIONS if hasattr(args, name)}


# -- the subcommands: each adds its parser and runs; COMMANDS lists them ------------------------------

def _packing(name: str) -> Command:
    """The subcommand of a packing kind: its parser, with the `--dask` help the first of them spells
    out and the others point to, and its run."""
    kind = KINDS[name]
    assert kind.add is not None and kind.run is not None
    dask = (f"{_DASK}: {_ADDRESSES} for a local cluster of N workers (needs the dask extra)" if name == _PACKING[0]
            else f"{_DASK} (see {_PACKING[0]})")
    return Command(functools.partial(kind.add, dask=dask), kind.run)


def _add_index(sub: Subparsers, name: str) -> argparse.ArgumentParser:
    """`shard-pack index KIND SRC... OUT`: original archives, indexed in place."""
    whats = ", or ".join(indexing.what for indexing in _INDEXED.values())
    p = sub.add_parser(name, help=f"index original archives in place ({whats}): OUT gets index files and a manifest, "
                       "never a copy of the data")
    kinds = p.add_subparsers(dest="index_kind", required=True)
    for kind, indexing in _INDEXED.items():
        k = kinds.add_parser(kind, help=indexing.help, parents=[
            quiet(), storage(), fractions(", as packing"),
            workers("processes scanning archives", dask=f"scan the archives on a Dask cluster, one task each: "
                    f"{_ADDRESSES} (see {_PACKING[0]}); the workers must reach the archives")])
        k.add_argument("sources", nargs="+", metavar="SRC", help=".tar archives or folders of them (local or URLs)")
        k.add_argument("out", metavar="OUT", help="dataset folder: the archives may sit in it (named relative to it)")
    return p


def _index(args: argparse.Namespace) -> int:
    return summary(index_archives(args.index_kind, args.sources, args.out, splits=parse_splits(args.split),
                                  workers=args.workers, max_skipped=args.max_skipped, progress=not args.quiet,
                                  dask=args.dask, storage_options=args.storage_options))


def _dataset(sub: Subparsers, name: str, parents: list[argparse.ArgumentParser], *, out: str = "dataset folder or URL",
             **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of a subcommand that reads a dataset: OUT (`out`: its help)."""
    p = sub.add_parser(name, parents=parents, **kwargs)
    p.add_argument("out", metavar="OUT", help=out)
    return p


_OR_SIDECAR = "dataset folder or URL, or a sidecar of outputs (pipeline.OutputWriter's)"


def _add_inspect(sub: Subparsers, name: str) -> argparse.ArgumentParser:
    return _dataset(sub, name, [storage()], out=_OR_SIDECAR, help="print a dataset's manifest summary (of a sidecar "
                    "of outputs: what it is of, its fields, and each epoch, complete or each rank's commits)")


def _inspect(args: argparse.Namespace) -> int:
    if is_sidecar(args.out, args.storage_options):
        print("\n".join(describe_sidecar(args.out, args.storage_options)))
    else:
        print("\n".join(describe(read_manifest(args.out, args.storage_options), args.out)))
    return 0


def _add_verify(sub: Subparsers, name: str) -> argparse.ArgumentParser:
    p = _dataset(sub, name, [quiet(), storage(), allow()], out=_OR_SIDECAR,
                 help="check every shard's checksum and index, and decode every sample (of a sidecar of outputs: "
                 "every chunk's and item index's checksum, and every record's members)")
    p.add_argument("--dataset", dest="datasets", action="append", default=[], metavar="ROOT",
                   help="for a sidecar of outputs: a dataset its outputs are of, checked to be the one they are of "
                   "(its fingerprint), each record under its sample's key; repeat for several, in the loader's order")
    return p


def _verify(args: argparse.Namespace) -> int:
    if is_sidecar(args.out, args.storage_options):
        problems = verify_sidecar(args.out, datasets=args.datasets, progress=not args.quiet,
                                  storage_options=args.storage_options, allowed_roots=args.allowed_roots)
    elif args.datasets:
        raise ConfigError(f"--dataset names the datasets a sidecar of outputs is of; {args.out} is not a sidecar")
    else:
        problems = verify(args.out, progress=not args.quiet, storage_options=args.storage_options,
                          allowed_roots=args.allowed_roots)
    for problem in problems:
        print(problem)
    print(f"verify: {len(problems)} problems" if problems else "verify: OK")
    return 1 if problems else 0


def _add_upgrade(sub: Subparsers, name: str) -> argparse.ArgumentParser:
    return _dataset(sub, name, [quiet(), storage()], help="write the shard indexes and manifest of the current "
                    "schema for an older dataset, in place (no shard is rewritten; safe to run again)")


def _upgrade(args: argparse.Namespace) -> int:
    print(upgrade(args.out, progress=not args.quiet, storage_options=args.storage_options))
    return 0


def _add_tune(sub: Subparsers, name: str) -> argparse.ArgumentParser:
    p = _dataset(sub, name, [quiet(), storage(), allow(), _kind_options()], help="measure the loader on this "
                 "dataset and machine across num_workers (prefetch_factor, read_ahead) and recommend settings",
                 description="Run each setting in a subprocess of its own; print samples/s, CPU per sample, "
                 "peak memory of the process tree and time to the first batch per setting, and recommend, among "
                 f"the settings within {WITHIN:.0%} of the best throughput, the one of least peak memory.")
    p.add_argument("--split", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    workers = ",".join(map(str, default_workers()))
    p.add_argument("--workers", type=_ints, help=f"num_workers to try (default: {workers})")
    p.add_argument("--prefetch", type=_ints, default=(2,), help="prefetch_factor values to try with workers (2)")
    p.add_argument("--read-ahead", type=_ints, default=(1,),
                   help="read_ahead values to try (1; matters for object storage)")
    p.add_argument("--batches", type=int, default=20, help="timed batches per setting (20)")
    p.add_argument("--warmup", type=int, default=3, help="batches read before timing, the first included (3)")
    p.add_argument("--seconds", type=float, default=15.0, help="at most this long timing a setting (15)")
    p.add_argument("--device", help="as make_stream_loader's, e.g. cuda (default: batches stay on the CPU)")
    p.add_argument("--plot", metavar="FILE.png", help="draw samples/s and CPU per sample against num_workers")
    p.add_argument("--json", metavar="FILE", help="write the rows and the recommendation as JSON")
    return p


def _tune(args: argparse.Namespace) -> int:
    result = tune(args.out, args.split, batch_size=args.batch_size, workers=args.workers,
                  prefetch_factors=args.prefetch, read_aheads=args.read_ahead, batches=args.batches,
                  warmup=args.warmup, seconds=args.seconds, device=args.device, options=_kind(args),
                  progress=not args.quiet, storage_options=args.storage_options, allowed_roots=args.allowed_roots)
    print("\n".join(result.lines()))
    if args.plot:
        write_png(plot(result), args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result.to_json(), indent=1) + "\n")
        print(f"rows: {args.json}")
    return 0


def _add_preview(sub: Subparsers, name: str) -> argparse.ArgumentParser:
    p = _dataset(sub, name, [storage(), allow(), _kind_options()], help="draw a split's first decoded samples as "
                 f"the loader yields them ({'; '.join(k.preview.shows for k in KINDS.values() if k.preview)})")
    p.add_argument("--split", required=True)
    p.add_argument("-n", type=int, default=8, help="samples (8)")
    p.add_argument("--out", dest="png", required=True, metavar="FILE.png", help="where to write the picture")
    p.add_argument("--seed", type=int, default=0, help="the shuffle's seed: which samples come first (0)")
    p.add_argument("--tile", type=int, default=256, help="long side of each sample's picture, pixels (256)")
    p.add_argument("--columns", type=int, default=4, help="pictures per row (4)")
    return p


def _preview(args: argparse.Namespace) -> int:
    shown = preview(args.out, args.split, n=args.n, seed=args.seed, tile=args.tile, columns=args.columns,
                    options=_kind(args), storage_options=args.storage_options,
                    allowed_roots=args.allowed_roots)
    write_png(shown.image, args.png)
    print(f"preview: {args.png} ({shown.image.width}x{shown.image.height}): {', '.join(shown.keys)}")
    return 0


# A new subcommand is one entry here: its parser (`add`) and what it does (`run`); a packing kind's
# comes from the registry (`shard_tools.kinds`). In `--help` order.
COMMANDS: dict[str, Command] = {
    **{name: _packing(name) for name in _PACKING},
    "index": Command(_add_index, _index),
    "inspect": Command(_add_inspect, _inspect),
    "verify": Command(_add_verify, _verify),
    "link": Command(add_link, run_link),
    "upgrade": Command(_add_upgrade, _upgrade),
    "tune": Command(_add_tune, _tune),
    "preview": Command(_add_preview, _preview),
}


_ABOUT = ("`shard-pack`: pack datasets into shards ({packing}), index original archives in place ({indexed}), "
          "read them back (`inspect`, `verify`; also a sidecar of outputs), link a dataset's vectors to "
          "another's samples by key (`link`), measure and draw them as the loader "
          "reads them (`tune`, `preview`), and bring older datasets to the current schema (`upgrade`).")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shard-pack", description=_ABOUT.format(
        packing=", ".join(f"`{name}`" for name in _PACKING), indexed=", ".join(f"`index {name}`" for name in _INDEXED)),
        parents=[quiet(False, "no progress bar or progress lines")])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add(sub, name)
    return parser


# -- main -----------------------------------------------------------------------------------------

# Loggers whose INFO lines are noise here: where credentials came from; azure-core's every request; Dask's workers.
_QUIET = {"botocore", "aiobotocore", "s3fs", "fsspec", "distributed", "azure", "adlfs"}


def _libraries_quiet(record: logging.LogRecord) -> bool:
    """Shows a library's record only from WARNING up (a filter on our handler as well as their levels:
    Dask sets its loggers' levels itself when it is imported)."""
    return record.levelno >= logging.WARNING or record.name.partition(".")[0] not in _QUIET


def _logging() -> None:
    """INFO and up to stderr, as plain lines; the libraries' only from WARNING."""
    made = not logging.getLogger().handlers
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for handler in logging.getLogger().handlers if made else ():
        handler.addFilter(_libraries_quiet)
    for noisy in _QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING)


_KEPT = "; the finished shards are kept: fix that, then run the same command again"


def _botocore_errors() -> tuple[type[BaseException], ...]:
    """botocore's own errors (no credentials, an endpoint it cannot reach), which s3fs lets through
    where it reads or writes: the environment's, not bugs. None without the s3 extra."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return ()
    return BotoCoreError, ClientError


def _azure_errors() -> tuple[type[BaseException], ...]:
    """azure-core's errors (refused credentials, an endpoint it cannot reach), which adlfs lets through
    where it reads or writes. None without the azure extra."""
    try:
        from azure.core.exceptions import AzureError
    except ImportError:
        return ()
    return (AzureError,)


# What each error means to the caller (the module's docstring): the first entry whose classes match
# gives the exit code and the line logged. An error none matches is a bug: it ends in a traceback.
EXITS: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], int, Callable[[BaseException], str]], ...] = (
    ((TooManySkipped, InputError), 1, str),
    ((ShardstreamError, ValueError, FileNotFoundError), 2, str),  # PackError among them; ValueError: a flag's check
    (TuneError, 3, str),
    (BrokenProcessPool, 3, lambda exc: "a packing worker process died (killed, or out of memory?)" + _KEPT),
    (OSError, 3, lambda exc: f"{exc}{_KEPT}"),
    (_botocore_errors(), 2, lambda exc: f"object storage: {type(exc).__name__}: {exc} (its credentials and endpoint: "
                                        "--storage-options, or the environment's AWS_*)"),
    (_azure_errors(), 2, lambda exc: f"object storage: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]} "
                                     "(its account and credentials: --storage-options, or the environment's "
                                     "AZURE_STORAGE_*)"),
    (KeyboardInterrupt, 130, lambda exc: str(exc) or "interrupted"),  # Interrupted (pack, index) says how far they got
)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _logging()
    try:
        return COMMANDS[args.command].run(args)
    except (Exception, KeyboardInterrupt) as exc:
        for kinds, code, message in EXITS:
            if isinstance(exc, kinds):
                log.error("shard-pack: %s", message(exc))
                return code
        raise


if __name__ == "__main__":
    sys.exit(main())
