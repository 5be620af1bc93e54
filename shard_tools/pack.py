"""The packing driver, kind-agnostic: input listing -> split -> shard tasks -> shards -> manifest.

Each shard task is a pure function of a fixed, sorted slice of the input, so the output is
byte-identical whatever the number of processes, and a task run twice writes the same bytes.
Shards are written under unique `.partial-*` names and renamed (on object storage: uploaded
whole, so an object is complete when it appears); each finished task leaves a record in
`OUT/_pack/`, so an interrupted run started again with the same arguments only does the rest.
The manifest is written last (atomically) and lists only finished shards. OUT is a local folder
or any fsspec URL (`s3://bucket/prefix`; credentials from the environment, as s3fs reads them).

Tasks run in-process (`workers=1`), in a local process pool, or on a Dask cluster (`dask=`):
the output is the same bytes in every case. Progress counts samples as they are written (on Dask:
as shards finish). A run refused, or ended before it finished a shard, leaves nothing behind; Ctrl-C
raises `Interrupted`, saying how far the pack got (the pool's workers ignore it: the parent stops them).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import glob
import hashlib
import json
import logging
import os
import posixpath
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol


from pipeline.errors import ConfigError, InputError, PackError, SampleError, TooManySkipped
from pipeline.format import MANIFEST_NAME, IndexInfo, Manifest, ShardIndex, ShardInfo, index_name, shard_name
from pipeline.storage import Retry, filesystem, is_local, join, with_retries, write_bytes
from pipeline.tario import ShardWriter
from shard_tools.outdir import STATE_DIR, exists, remove_debris, start, unstart
from shard_tools.progress import Progress
from shard_tools.runners import dask_tasks, exit_with_parent, pool_tick, worker_pool

__all__ = [
    "Part", "SampleRef", "PackOptions", "PackSummary", "PackError", "Interrupted", "Progress", "TooManySkipped",
    "Source", "pack", "parse_splits", "split_of", "exit_with_parent", "pool_tick", "worker_pool", "dask_tasks",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Part:
    """One input file, or one member of an input archive: where its bytes are and how to name it."""

    url: str  # the file or archive holding the bytes
    offset: int
    size: int
    name: str  # for messages and the manifest: "sa_000000.tar:sa_1.jpg" or "images/sa_1.jpg"


@dataclasses.dataclass(frozen=True)
class SampleRef:
    key: str
    parts: tuple[tuple[str, Part], ...]  # (role, part), e.g. ("jpg", ...), ("json", ...)
    split: str | None = None  # set by sources whose input says the split (else: by key hash)
    units: int = 1  # units the loader yields from this sample (e.g. questions of an image)

    @property
    def size(self) -> int:
        return sum(p.size for _, p in self.parts)


class Source(Protocol):
    """What a kind provides to the driver (see shard_tools.sa1b)."""

    kind: str

    def index(self, sources: Sequence[str]) -> tuple[list[SampleRef], list[dict[str, str]]]: ...

    def encode(self, ref: SampleRef) -> tuple[list[tuple[str, bytes]], dict[str, int]]: ...

    def options(self) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """Kind-independent packing settings."""

    shard_samples: int = 1000
    shard_bytes: int = 1 << 30  # of input: the shard on disk is about that or smaller
    splits: tuple[tuple[str, float], ...] | None = (("train", 1.0),)  # None: the source sets each sample's split
    workers: int = 1
    max_skipped: int = 10
    dask: str | None = None  # a scheduler address (tcp://host:8786) or local:N for a local cluster
    task_retries: int = 2  # on Dask: further tries of a failed shard task
    # fsspec's options for OUT (as `--storage-options`; a source has its own for its inputs): never in the manifest
    storage_options: dict[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("shard_samples", "shard_bytes", "workers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_skipped, int) or self.max_skipped < 0:
            raise ConfigError(f"max_skipped must be an int >= 0, got {self.max_skipped!r}")
        if self.splits is not None:  # (None: the source sets each sample's split)
            names = [n for n, _ in self.splits]
            if not names or len(set(names)) != len(names) or any(not n.isidentifier() for n in names):
                raise ConfigError(f"split names must be distinct identifiers, got {names}")
            if any(f <= 0 for _, f in self.splits) or abs(sum(f for _, f in self.splits) - 1) > 1e-9:
                raise ConfigError(f"split fractions must be > 0 and sum to 1, got {dict(self.splits)}")
        if self.dask is not None and not (self.dask.startswith(("tcp://", "tls://", "ucx://", "inproc://"))
                                          or self.dask.removeprefix("local:").isdigit()):
            raise ConfigError(f"dask must be a scheduler address (tcp://host:8786) or local:N, got {self.dask!r}")


def parse_splits(text: str) -> tuple[tuple[str, float], ...]:
    """'train=0.99,val=0.01' -> (("train", 0.99), ("val", 0.01))."""
    try:
        pairs = [item.split("=") for item in text.split(",")]
        return tuple((name.strip(), float(value)) for name, value in pairs)
    except ValueError as exc:
        raise ConfigError(f"invalid split spec {text!r}: want name=fraction[,name=fraction...]") from exc


def split_of(key: str, splits: Sequence[tuple[str, float]]) -> str:
    """The split a key belongs to: a fixed hash of the key against the cumulative fractions."""
    u = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
    bound = 0.0
    for name, fraction in splits:
        bound += fraction
        if u < bound:
            return name
    return splits[-1][0]


@dataclasses.dataclass(frozen=True)
class _Task:
    split: str
    index: int
    refs: tuple[SampleRef, ...]

    @property
    def name(self) -> str:
        return shard_name(self.split, self.index)


def _plan(refs: Sequence[SampleRef], options: PackOptions) -> list[_Task]:
    """Consecutive runs of each split's samples (in the source's order), cut at `shard_samples` or
    `shard_bytes` of input. The split is the source's (`ref.split`) or, by default, a hash of the key."""
    by_split: dict[str, list[SampleRef]] = {}
    if options.splits is None:
        for ref in refs:
            if ref.split is None or not ref.split.isidentifier():
                raise PackError(f"sample {ref.key!r}: the source gives no valid split ({ref.split!r})")
            by_split.setdefault(ref.split, []).append(ref)
    else:
        by_split = {name: [] for name, _ in options.splits}
        for ref in refs:
            by_split[split_of(ref.key, options.splits)].append(ref)
    tasks = []
    for split, members in by_split.items():
        chunks: list[list[SampleRef]] = []
        size = 0
        for ref in members:
            if not chunks or len(chunks[-1]) == options.shard_samples or size + ref.size > options.shard_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(ref)
            size += ref.size
        tasks += [_Task(split, i, tuple(chunk)) for i, chunk in enumerate(chunks)]
    return tasks


def _run_task(source: Source, task: _Task, out: str, storage_options: dict[str, Any] | None,
              tick: Callable[[int], None] | None) -> dict[str, Any]:
    """Write one shard; bad samples are skipped and reported; `tick(1)` after each sample. Pure in its
    inputs: same bytes every time.

    On object storage the shard is written to a local temporary file, then uploaded in one piece
    (an object appears only when its upload completes)."""
    fs, base = filesystem(out, storage_options)
    local = is_local(fs)
    target = join(base, task.name)
    with contextlib.ExitStack() as stack:
        if not local:
            target = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="shard-pack-")), task.name)
        record, index = _write_shard(source, task, target, tick)
        if not local:
            with_retries(Retry(), join(out, task.name), lambda: fs.put_file(target, join(base, task.name)))
    write_bytes(fs, join(base, index_name(task.name)), index)  # after its shard, before the record
    write_bytes(fs, join(base, f"{STATE_DIR}/{task.name}.json"), json.dumps(record).encode())
    return record


def _write_shard(source: Source, task: _Task, path: str,
                 tick: Callable[[int], None] | None) -> tuple[dict[str, Any], bytes]:
    """(the task's record, the shard's index file)."""
    writer = ShardWriter(path)
    skipped, counts, units = [], {"samples": 0}, []
    try:
        for ref in task.refs:
            try:
                members, stats = source.encode(ref)
            except SampleError as exc:
                skipped.append({"source": exc.url, "key": ref.key, "reason": str(exc)})
            else:
                writer.add(ref.key, members)
                units.append(ref.units)
                counts["samples"] += 1
                for name, value in stats.items():
                    counts[name] = counts.get(name, 0) + value
            if tick is not None:
                tick(1)
        sha = writer.close()
    except BaseException:
        writer.abort()
        raise
    index = ShardIndex.build(writer.keys, units, writer.members).to_bytes(writer.size)
    shard = {"name": task.name, "samples": len(writer.keys), "units": sum(units), "bytes": writer.size, "sha256": sha,
             "index": list(dataclasses.astuple(IndexInfo.of(task.name, index)))}
    return {"shard": shard, "skipped": skipped, "counts": counts, "split": task.split}, index


@dataclasses.dataclass
class PackSummary:
    samples: int = 0
    shards: int = 0
    bytes: int = 0
    skipped: int = 0
    reused: int = 0  # shards finished by an earlier, interrupted run
    reused_samples: int = 0  # the samples in them
    seconds: float = 0.0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # kind-specific, e.g. masks
    skip_list: list[dict[str, str]] = dataclasses.field(default_factory=list)
    complete: bool = False  # the pack was complete before this run, which did nothing

    def lines(self) -> list[str]:
        if self.complete:
            return [f"already complete: {self.samples} samples in {self.shards} shards, {self.bytes / 1e6:.1f} MB, "
                    f"{self.skipped} skipped; nothing to do"]
        extra = "".join(f", {v} {k}" for k, v in sorted(self.counts.items()) if k != "samples")
        reused = f" ({self.reused} shards reused from an interrupted run)" if self.reused else ""
        written = self.samples - self.reused_samples
        rate = f", {written / self.seconds:.1f} samples/s" if written and self.seconds else ""
        return [
            f"packed {self.samples} samples{extra} into {self.shards} shards, {self.bytes / 1e6:.1f} MB{reused}",
            f"skipped {self.skipped}; {self.seconds:.1f} s{rate}",
        ]


def _fingerprint(kind: str, options: dict[str, Any], refs: Iterable[SampleRef]) -> str:
    digest = hashlib.sha256(json.dumps([kind, options], sort_keys=True).encode())
    for ref in refs:
        digest.update(json.dumps([ref.key, [(r, p.name, p.size) for r, p in ref.parts], ref.split, ref.units]).encode())
    return digest.hexdigest()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a pack or an index run: a KeyboardInterrupt whose message says how far the run
    got and what running it again does."""


def pack(
    source: Source,
    sources: Sequence[str],
    out: str,
    options: PackOptions,
    *,
    progress: bool = True,
    on_shard: Callable[[str], None] | None = None,
) -> PackSummary:
    """Pack `sources` into shards + manifest at `out`; resumes an interrupted run of the same pack.

    Raises InputError if the sources hold no sample; PackError if `out` holds another dataset or
    an unfinished pack of other inputs, or if more than `options.max_skipped` samples are skipped
    (the shards are kept and the manifest is not written; run again with a higher limit to finish
    without redoing them); Interrupted on Ctrl-C. A run refused, or ended before it finished a
    shard, leaves nothing behind (no `_pack/` record of it, no OUT it made).
    `on_shard(name)` is called after each shard is finished (the tests interrupt packs with it).
    """
    started = time.monotonic()
    refs, skipped = _listed(source, sources)
    stored_options = _stored_options(source, options)
    fingerprint = _fingerprint(source.kind, stored_options, refs)
    fs, base = filesystem(out, options.storage_options)
    existing = _finished_pack(fs, base, out, fingerprint)
    if existing is not None:
        return _summary(existing, time.monotonic() - started, complete=True)
    tasks = _plan(refs, options)
    made = start(fs, base, out, fingerprint)
    records = _reusable_records(fs, base, tasks)
    reused, reused_samples = len(records), sum(r["shard"]["samples"] for r in records.values())
    todo = [t for t in tasks if t.name not in records]
    log.info("%d samples in %d shards to write (%d already done); %d inputs skipped while listing",
             sum(len(t.refs) for t in todo), len(todo), reused, len(skipped))
    try:
        records.update(_write_shards(source, todo, out, options, progress, on_shard))
    except KeyboardInterrupt as exc:
        done = _samples_recorded(fs, base, tasks)
        if made is not None:
            unstart(fs, base, made)
        raise Interrupted(f"interrupted after {done} of {len(refs)} samples; run the same command to resume") from exc
    except BaseException:
        if made is not None:
            unstart(fs, base, made)
        raise
    all_skipped = _all_skipped(skipped, records, options, out)
    names = [n for n, _ in options.splits] if options.splits is not None else sorted({t.split for t in tasks})
    splits = {name: tuple(_shard_info(records[t.name]["shard"]) for t in tasks if t.split == name) for name in names}
    manifest = Manifest(source.kind, splits, stored_options, fingerprint, tuple(all_skipped))
    _finish(fs, base, tasks, manifest)
    return _summary(manifest, time.monotonic() - started, reused=reused, reused_samples=reused_samples,
                    counts=_counts(records))


def _listed(source: Source, sources: Sequence[str]) -> tuple[list[SampleRef], list[dict[str, str]]]:
    """The source's samples and the inputs it skipped; InputError if there is no sample."""
    refs, skipped = source.index(sources)
    if not refs:
        first = f"; the first: {skipped[0]['reason']}" if skipped else ""
        raise InputError(f"no {source.kind} samples to pack ({len(skipped)} inputs skipped{first})",
                         url=", ".join(sources))
    return refs, skipped


def _stored_options(source: Source, options: PackOptions) -> dict[str, Any]:
    """The options the manifest records (and the fingerprint covers): those that change the shards."""
    return {
        "kind_options": source.options(),
        "shard_samples": options.shard_samples,
        "shard_bytes": options.shard_bytes,
        "splits": None if options.splits is None else [list(s) for s in options.splits],
    }


def _finished_pack(fs: Any, base: str, out: str, fingerprint: str) -> Manifest | None:
    """The manifest of the same pack when OUT already holds it; PackError when it holds another dataset."""
    manifest_path = join(base, MANIFEST_NAME)
    if not exists(fs, manifest_path):
        return None
    existing = Manifest.from_json(fs.cat_file(manifest_path), join(out, MANIFEST_NAME))
    if existing.fingerprint != fingerprint:
        raise PackError(f"{out} already holds a dataset packed from other inputs or options; use a new folder")
    return existing


def _reusable_records(fs: Any, base: str, tasks: Sequence[_Task]) -> dict[str, dict[str, Any]]:
    """The records of the tasks an earlier, interrupted run finished (shard and index in place)."""
    state = join(base, STATE_DIR)
    records: dict[str, dict[str, Any]] = {}
    for task in tasks:
        record_path = join(state, task.name + ".json")
        finished = [record_path, join(base, task.name), join(base, index_name(task.name))]
        if all(exists(fs, path) for path in finished):
            records[task.name] = json.loads(fs.cat_file(record_path))
    return records


def _write_shards(source: Source, todo: list[_Task], out: str, options: PackOptions, progress: bool,
                  on_shard: Callable[[str], None] | None) -> dict[str, dict[str, Any]]:
    """Run the tasks left to do, with a progress count of their samples: each task's record."""
    records: dict[str, dict[str, Any]] = {}
    bar = Progress(sum(len(t.refs) for t in todo), progress)
    try:
        with contextlib.closing(_execute(source, todo, out, options, bar)) as results:
            for task, record in results:
                records[task.name] = record
                if on_shard is not None:
                    on_shard(task.name)
    finally:
        bar.close()
    return records


def _samples_recorded(fs: Any, base: str, tasks: Sequence[_Task]) -> int:
    """The samples of every shard finished so far (by this run or an earlier one): each left a record."""
    recorded = {posixpath.basename(p) for p in fs.ls(join(base, STATE_DIR), detail=False, refresh=True)}
    return sum(len(t.refs) for t in tasks if f"{t.name}.json" in recorded)


def _all_skipped(listing: list[dict[str, str]], records: dict[str, dict[str, Any]], options: PackOptions,
                 out: str) -> list[dict[str, str]]:
    """Every sample skipped, while listing or writing, in key order; TooManySkipped past the limit."""
    written = [s for r in records.values() for s in r["skipped"]]
    skipped = sorted(listing + written, key=lambda s: (s["key"], s["source"]))
    if len(skipped) > options.max_skipped:
        for s in skipped[:20]:
            log.error("skipped %s", s["reason"])
        raise TooManySkipped(
            f"{len(skipped)} samples skipped, more than --max-skipped {options.max_skipped}; the shards are kept "
            f"in {out} but no manifest was written (fix the input, or run again with a higher --max-skipped)"
        )
    return skipped


def _finish(fs: Any, base: str, tasks: Sequence[_Task], manifest: Manifest) -> None:
    """Write the manifest, last: it lists only shards and indexes already in place; then remove the
    run's state and the debris of writers killed in an earlier run."""
    write_bytes(fs, join(base, MANIFEST_NAME), manifest.to_json())
    fs.rm(join(base, STATE_DIR), recursive=True)
    if is_local(fs):
        for task in tasks:
            for name in (task.name, index_name(task.name)):
                for partial in glob.glob(glob.escape(join(base, name)) + ".partial-*"):
                    os.unlink(partial)


def _counts(records: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The kind's counts (samples, masks, ...) summed over the shards."""
    counts: dict[str, int] = {}
    for record in records.values():
        for name, value in record["counts"].items():
            counts[name] = counts.get(name, 0) + value
    return counts


def _shard_info(record: dict[str, Any]) -> ShardInfo:
    index = IndexInfo(*record["index"])
    return ShardInfo(record["name"], record["samples"], record["units"], record["bytes"], record["sha256"], index)


def _summary(manifest: Manifest, seconds: float, **more: Any) -> PackSummary:
    shards = [s for split in manifest.splits.values() for s in split]
    return PackSummary(
        samples=sum(s.samples for s in shards), shards=len(shards), bytes=sum(s.bytes for s in shards),
        skipped=len(manifest.skipped), seconds=seconds, skip_list=list(manifest.skipped), **more,
    )


def _execute(source: Source, tasks: list[_Task], out: str, options: PackOptions,
             bar: Progress) -> Iterator[tuple[_Task, dict[str, Any]]]:
    """Each task run and its record, as they finish; `bar` counts their samples as they are written."""
    remove_debris(out, options.storage_options)
    if options.dask is not None:
        for task, record in _execute_dask(source, tasks, out, options):
            bar.update(len(task.refs))  # (per shard: a worker of a cluster has no cheap channel back per sample)
            yield task, record
        return
    if options.workers == 1 or len(tasks) <= 1:
        for task in tasks:
            yield task, _run_task(source, task, out, options.storage_options, bar.update)
        return
    calls = [(_run_task, source, task, out, options.storage_options, pool_tick) for task in tasks]
    with worker_pool(min(options.workers, len(tasks)), calls) as (futures, done):
        pending = dict(zip(futures, tasks))
        while pending:
            finished, _ = concurrent.futures.wait(pending, timeout=0.1, return_when=concurrent.futures.FIRST_COMPLETED)
            bar.update(done.value - bar.done)
            for future in finished:
                yield pending.pop(future), future.result()


def _execute_dask(source: Source, tasks: list[_Task], out: str,
                  options: PackOptions) -> Iterable[tuple[_Task, dict[str, Any]]]:
    """The same shard tasks on a Dask cluster (`dask_tasks`). Workers write to `out` themselves: on a
    real cluster it must be storage they all reach."""
    assert options.dask is not None
    calls = [(_run_task, source, task, out, options.storage_options) for task in tasks]
    names = [f"shard {task.name}" for task in tasks]
    with contextlib.closing(dask_tasks(options.dask, calls, names, retries=options.task_retries)) as results:
        for position, record in results:
            yield tasks[position], record
