"""`shard-pack`: pack datasets into shards (`sa1b`, `vqa`, `embeddings`), index original archives in
place (`index sa1b`, `index webdataset`), read them back (`inspect`, `verify`), measure and draw
them as the loader reads them (`tune`, `preview`), and bring older
datasets to the current schema (`upgrade`).

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
import dataclasses
import json
import logging
import os
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pipeline.errors import InputError, ShardstreamError
from pipeline.storage import read_manifest
from shard_tools.embeddings import SCHEMA_NAME, pack_embeddings
from shard_tools.index import IndexSummary, index_archives
from shard_tools.pack import PackOptions, PackSummary, TooManySkipped, pack, parse_splits
from shard_tools.preview import preview, write_png
from shard_tools.sa1b import Sa1bSource
from shard_tools.tune import WITHIN, TuneError, default_workers, plot, tune
from shard_tools.verify import describe, upgrade, verify
from shard_tools.vqa import LAYOUTS, VqaSource, pack_vqa

__all__ = ["COMMANDS", "EXITS", "Command", "main"]

log = logging.getLogger("shard-pack")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 500MB, 1GiB or a number of bytes")
    return int(float(match[1]) * _UNITS[match[2] or ""])


def _storage_options(text: str) -> dict[str, Any]:
    """`--storage-options`: a JSON object, given as it is or as `@FILE`. Messages never echo it (it may
    hold credentials)."""
    if text.startswith("@"):
        try:
            text = pathlib.Path(text[1:]).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]!r}: {getattr(exc, 'strerror', None) or exc}") from None
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


def _split_file(text: str) -> tuple[str, str]:
    name, _, file = text.partition("=")
    if not name.strip() or not file.strip():
        raise argparse.ArgumentTypeError(f"invalid split {text!r}: want NAME=FILE, e.g. train=train.json")
    return name.strip(), file.strip()


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: want integers separated by commas, e.g. 0,2,4") from None


def _int_or_none(text: str) -> int | None:
    try:
        return None if text.lower() == "none" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: want an integer or 'none'") from None


# -- flags several subcommands share, each set defined once as a parent parser ----------------------

def _quiet(default: Any = argparse.SUPPRESS, text: str = "no progress bar or lines") -> argparse.ArgumentParser:
    """`-q`, before the subcommand (default False) or after it (SUPPRESS: a -q given before stays set)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-q", "--quiet", action="store_true", default=default, help=text)
    return parser


def _storage() -> argparse.ArgumentParser:
    """`--storage-options`: every subcommand that reads a dataset or archives by URL."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--storage-options", type=_storage_options, metavar="JSON", help="fsspec's options for "
                        """the URLs read, as make_stream_loader's storage_options: a JSON object, e.g. '{"client_kwargs": """
                        """{"endpoint_url": "https://s3.example.com"}}', or @FILE holding one (credentials stay off """
                        "the command line); default: the environment's (AWS_*)")
    return parser


def _allow() -> argparse.ArgumentParser:
    """`--allow-root`: every subcommand that reads a dataset's shards."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--allow-root", dest="allowed_roots", action="append", default=[], metavar="ROOT",
                        help="a folder or URL outside the dataset's folder that its manifest may name (archives "
                        "indexed in place elsewhere; make_stream_loader's allowed_roots); repeat for several")
    return parser


def _shards(items: str, data: str = "input") -> argparse.ArgumentParser:
    """`--shard-samples`, `--shard-bytes`: when a shard is full (every packing subcommand)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--shard-samples", type=int, default=1000, help=f"at most this many {items} per shard (1000)")
    parser.add_argument("--shard-bytes", type=_size, default="1GiB", help=f"at most this much {data} per shard (1GiB)")
    return parser


def _fractions(how: str = "") -> argparse.ArgumentParser:
    """`--split`: split fractions by key hash (`sa1b`, `index`)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--split", default="train=1", help=f"split fractions by key hash{how}, e.g. train=0.99,val=0.01")
    return parser


def _images(max_side: str) -> argparse.ArgumentParser:
    """`--image-max-side`, `--jpeg-quality`: re-encoding images (`sa1b`, `vqa`)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--image-max-side", type=int, help=max_side)
    parser.add_argument("--jpeg-quality", type=int, default=90, help="quality of re-encoded JPEGs (90)")
    return parser


_DASK = "run the shard tasks on a Dask cluster (see sa1b)"


def _workers(what: str = "processes", skipped: str | None = "input samples", dask: str = _DASK) -> argparse.ArgumentParser:
    """`--workers`, `--max-skipped` (where `skipped` names the inputs), `--dask`: where the work runs,
    and how many bad inputs end it (packing and `index`)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help=f"{what} (all cores)")
    if skipped:
        parser.add_argument("--max-skipped", type=int, default=10, help=f"fail when more {skipped} are bad (10)")
    parser.add_argument("--dask", metavar="ADDRESS", help=dask)
    return parser


def _kind_options() -> argparse.ArgumentParser:
    """The loader's kind options (`tune`, `preview`); only those given are passed on."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("kind options (as make_stream_loader's; default: the loader's)")
    group.add_argument("--image-size", type=_int_or_none, default=argparse.SUPPRESS, help="SA-1B, VQA (VQA: none = as stored)")
    group.add_argument("--mask-size", type=_int_or_none, default=argparse.SUPPRESS, help="SA-1B (none = the image frame)")
    group.add_argument("--max-masks", type=int, default=argparse.SUPPRESS, help="SA-1B")
    group.add_argument("--per", choices=["question", "image"], default=argparse.SUPPRESS, help="VQA")
    group.add_argument("--fields", type=lambda t: tuple(t.split(",")), default=argparse.SUPPRESS,
                       help="embeddings: the fields to read, e.g. question_emb,relevance")
    return parser


_KIND_OPTIONS = ("image_size", "mask_size", "max_masks", "per", "fields")


def _kind(args: argparse.Namespace) -> dict[str, Any]:
    """The kind options given on the command line (one not given is absent: its default is SUPPRESS)."""
    return {name: getattr(args, name) for name in _KIND_OPTIONS if hasattr(args, name)}


# -- the subcommands: each adds its parser and runs; COMMANDS lists them ------------------------------

_Subparsers = argparse._SubParsersAction
_OUT = "output folder (new or empty, or an interrupted pack of the same input)"


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: `add(subparsers, name)` adds its parser; `run(args)` does it and returns the exit code."""

    add: Callable[[_Subparsers, str], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], int]


def _summary(summary: PackSummary | IndexSummary) -> int:
    """Prints a pack's or an index run's summary, after its first skipped inputs (logged)."""
    for skip in summary.skip_list[:20]:
        log.warning("skipped %s", skip["reason"])
    print("\n".join(summary.lines()))
    return 0


def _pack_options(args: argparse.Namespace, *, splits: Sequence[tuple[str, float]] | None,
                  max_skipped: int) -> PackOptions:
    return PackOptions(shard_samples=args.shard_samples, shard_bytes=args.shard_bytes, splits=splits,
                       workers=args.workers, max_skipped=max_skipped, dask=args.dask)


def _add_sa1b(sub: _Subparsers, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[_quiet(), _shards("samples"), _fractions(),
                                      _images("re-encode larger JPEGs to this long side (masks stay exact)"),
                                      _workers(dask="run the shard tasks on a Dask cluster: tcp://scheduler:8786, or "
                                               "local:N for a local cluster of N workers (needs the dask extra)")],
                       help="pack SA-1B (.tar archives and/or folders of sa_<id>.jpg + sa_<id>.json)")
    p.add_argument("sources", nargs="+", metavar="SRC", help="SA-1B .tar archives or folders")
    p.add_argument("out", metavar="OUT", help=_OUT)
    return p


def _sa1b(args: argparse.Namespace) -> int:
    options = _pack_options(args, splits=parse_splits(args.split), max_skipped=args.max_skipped)
    source = Sa1bSource(image_max_side=args.image_max_side, jpeg_quality=args.jpeg_quality)
    return _summary(pack(source, args.sources, args.out, options, progress=not args.quiet))


def _add_vqa(sub: _Subparsers, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[_quiet(), _images("re-encode larger images to this long side (JPEG stays JPEG, "
                                                        "PNG stays lossless)"),
                                      _shards("images"), _workers(skipped="records or images")],
                       help="pack a VQA collection: question/answer files per split + an image folder")
    p.add_argument("out", metavar="OUT", help=_OUT)
    p.add_argument("--images", required=True, metavar="ROOT", help="folder (or URL) the records' image paths are in")
    p.add_argument("--split", dest="splits", action="append", required=True, type=_split_file, metavar="NAME=FILE",
                   help="a split and its annotation file (JSON list, or .jsonl); repeat for each split or file. An "
                   "image referenced from several splits belongs to the first given")
    p.add_argument("--layout", choices=sorted(LAYOUTS), help="the files' layout (default: detected per file)")
    p.add_argument("--image-key", help="for another layout: the record field holding the image path")
    p.add_argument("--question-key", help="... the question")
    p.add_argument("--answer-key", help="... the answer")
    p.add_argument("--shared-images", choices=["skip", "keep"], default="skip", help="an image in several splits: "
                   "skip its questions in the later splits as leakage (default), or keep it in each")
    return p


def _vqa(args: argparse.Namespace) -> int:
    options = _pack_options(args, splits=None, max_skipped=args.max_skipped)
    source = VqaSource(images=args.images, splits=tuple(args.splits), layout=args.layout, image_key=args.image_key,
                       question_key=args.question_key, answer_key=args.answer_key, shared_images=args.shared_images,
                       image_max_side=args.image_max_side, jpeg_quality=args.jpeg_quality)
    return _summary(pack_vqa(source, args.out, options, progress=not args.quiet))


def _add_embeddings(sub: _Subparsers, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[_quiet(), _shards("blocks", "data"), _workers(skipped=None)],
                       help="pack a folder of row-aligned arrays (.npy/.safetensors) described by a schema",
                       description="Check every array against the schema (lengths, NaN/Inf, declared ranges, "
                       "references, splits), then pack blocks of rows; nothing is written if a check fails. Schema: "
                       '{"fields": {"name": {"file": "name.npy", "tensor": "(in .safetensors)", "range": [low, high], '
                       '"index_into": rows or "table.npy"}, ...}, "splits": {"train": "train_idx.npy", ...}}')
    p.add_argument("source", metavar="DIR", help="folder of the arrays (and of schema.json)")
    p.add_argument("out", metavar="OUT", help=_OUT)
    p.add_argument("--schema", metavar="FILE", help=f"schema file (default: DIR/{SCHEMA_NAME})")
    p.add_argument("--rows-per-block", type=int, help="rows per block (default: a power of two, blocks of at most 4 MiB)")
    return p


def _embeddings(args: argparse.Namespace) -> int:
    options = _pack_options(args, splits=None, max_skipped=0)
    return _summary(pack_embeddings(args.source, args.out, schema=args.schema, rows_per_block=args.rows_per_block,
                                    options=options, progress=not args.quiet))


def _add_index(sub: _Subparsers, name: str) -> argparse.ArgumentParser:
    """`shard-pack index sa1b|webdataset SRC... OUT`: original archives, indexed in place."""
    p = sub.add_parser(name, help="index original archives in place (SA-1B as Meta ships it, or any WebDataset "
                       "tars): OUT gets index files and a manifest, never a copy of the data")
    kinds = p.add_subparsers(dest="index_kind", required=True)
    for kind, text in (("sa1b", "SA-1B .tar archives (sa_<id>.jpg + sa_<id>.json), every pair checked as packing does"),
                       ("webdataset", "any WebDataset tars (members grouped by key, as webdataset does)")):
        k = kinds.add_parser(kind, help=text, parents=[
            _quiet(), _storage(), _fractions(", as packing"),
            _workers("processes scanning archives", dask="scan the archives on a Dask cluster, one task each: "
                     "tcp://scheduler:8786, or local:N (see sa1b); the workers must reach the archives")])
        k.add_argument("sources", nargs="+", metavar="SRC", help=".tar archives or folders of them (local or URLs)")
        k.add_argument("out", metavar="OUT", help="dataset folder: the archives may sit in it (named relative to it)")
    return p


def _index(args: argparse.Namespace) -> int:
    return _summary(index_archives(args.index_kind, args.sources, args.out, splits=parse_splits(args.split),
                                   workers=args.workers, max_skipped=args.max_skipped, progress=not args.quiet,
                                   dask=args.dask, storage_options=args.storage_options))


def _dataset(sub: _Subparsers, name: str, parents: list[argparse.ArgumentParser], **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of a subcommand that reads a dataset: OUT."""
    p = sub.add_parser(name, parents=parents, **kwargs)
    p.add_argument("out", metavar="OUT", help="dataset folder or URL")
    return p


def _add_inspect(sub: _Subparsers, name: str) -> argparse.ArgumentParser:
    return _dataset(sub, name, [_storage()], help="print a dataset's manifest summary")


def _inspect(args: argparse.Namespace) -> int:
    print("\n".join(describe(read_manifest(args.out, args.storage_options), args.out)))
    return 0


def _add_verify(sub: _Subparsers, name: str) -> argparse.ArgumentParser:
    return _dataset(sub, name, [_quiet(), _storage(), _allow()],
                    help="check every shard's checksum and index, and decode every sample")


def _verify(args: argparse.Namespace) -> int:
    problems = verify(args.out, progress=not args.quiet, storage_options=args.storage_options,
                      allowed_roots=args.allowed_roots)
    for problem in problems:
        print(problem)
    print(f"verify: {len(problems)} problems" if problems else "verify: OK")
    return 1 if problems else 0


def _add_upgrade(sub: _Subparsers, name: str) -> argparse.ArgumentParser:
    return _dataset(sub, name, [_quiet(), _storage()], help="write the shard indexes and manifest of the current "
                    "schema for an older dataset, in place (no shard is rewritten; safe to run again)")


def _upgrade(args: argparse.Namespace) -> int:
    print(upgrade(args.out, progress=not args.quiet, storage_options=args.storage_options))
    return 0


def _add_tune(sub: _Subparsers, name: str) -> argparse.ArgumentParser:
    p = _dataset(sub, name, [_quiet(), _storage(), _allow(), _kind_options()], help="measure the loader on this "
                 "dataset and machine across num_workers (prefetch_factor, read_ahead) and recommend settings",
                 description="Run each setting in a subprocess of its own; print samples/s, CPU per sample, "
                 "peak memory of the process tree and time to the first batch per setting, and recommend, among "
                 f"the settings within {WITHIN:.0%} of the best throughput, the one of least peak memory.")
    p.add_argument("--split", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--workers", type=_ints, help=f"num_workers to try (default: {','.join(map(str, default_workers()))})")
    p.add_argument("--prefetch", type=_ints, default=(2,), help="prefetch_factor values to try with workers (2)")
    p.add_argument("--read-ahead", type=_ints, default=(1,), help="read_ahead values to try (1; matters for object storage)")
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


def _add_preview(sub: _Subparsers, name: str) -> argparse.ArgumentParser:
    p = _dataset(sub, name, [_storage(), _allow(), _kind_options()], help="draw a split's first decoded samples as "
                 "the loader yields them (SA-1B: masks and boxes over the image; VQA: question and answer; embeddings: "
                 "field statistics)")
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


# A new subcommand is one entry here: its parser (`add`) and what it does (`run`). In `--help` order.
COMMANDS: dict[str, Command] = {
    "sa1b": Command(_add_sa1b, _sa1b),
    "vqa": Command(_add_vqa, _vqa),
    "embeddings": Command(_add_embeddings, _embeddings),
    "index": Command(_add_index, _index),
    "inspect": Command(_add_inspect, _inspect),
    "verify": Command(_add_verify, _verify),
    "upgrade": Command(_add_upgrade, _upgrade),
    "tune": Command(_add_tune, _tune),
    "preview": Command(_add_preview, _preview),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shard-pack", description=__doc__.split("\n\n")[0],
                                     parents=[_quiet(False, "no progress bar or progress lines")])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command.add(sub, name)
    return parser


# -- main -----------------------------------------------------------------------------------------

_QUIET = {"botocore", "aiobotocore", "s3fs", "fsspec", "distributed"}  # INFO: where credentials came from; Dask's workers


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

# What each error means to the caller (the module's docstring): the first entry whose classes match
# gives the exit code and the line logged. An error none matches is a bug: it ends in a traceback.
EXITS: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], int, Callable[[BaseException], str]], ...] = (
    ((TooManySkipped, InputError), 1, str),
    ((ShardstreamError, ValueError, FileNotFoundError), 2, str),  # PackError among them; ValueError: a flag's check
    (TuneError, 3, str),
    (BrokenProcessPool, 3, lambda exc: "a packing worker process died (killed, or out of memory?)" + _KEPT),
    (OSError, 3, lambda exc: f"{exc}{_KEPT}"),
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
