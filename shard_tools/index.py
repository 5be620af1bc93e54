"""`shard-pack index`: make a dataset of original archives in place, writing only shard indexes and a
manifest; the archives are never copied. Which kinds can be indexed, and how a kind finds its
samples among an archive's members, is the kind's (`shard_tools.kinds`, `PackingKind.index`).

Each archive is read once, front to back in large blocks (its tar headers parsed, never extracted),
and its SHA-256 and size computed in the same pass; archives are scanned in parallel and the
output is byte-identical for any number of workers. A kind checks its samples as its packing does;
a bad one is skipped, named and counted. Samples go
to splits by key hash as packing puts them (`split_of`), so an archive may serve several splits,
each with an index file listing its samples only. Only regular files named `<key>.<ext>` with a
flat key are indexed (`./<key>.<ext>` too, as `tar -C dir .` writes): members in folders, links,
devices and names only an extended header holds are skipped with their archive and member named.
A key already seen (in an earlier archive, or earlier in the same one) is skipped as a duplicate.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import posixpath
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pipeline.errors import ConfigError, InputError, PackError, ShardError, TooManySkipped
from pipeline.format import MANIFEST_NAME, IndexInfo, Manifest, ShardIndex, ShardInfo, check_shard_name
from pipeline.storage import filesystem, is_local, join, read_manifest, write_bytes
from pipeline.storage.local import open_regular
from pipeline.storage.places import within
from pipeline.tario import scan_archive
from shard_tools.kinds import KINDS
from shard_tools.pack import Interrupted, PackOptions, split_of
from shard_tools.progress import Progress
from shard_tools.runners import dask_tasks, pool_tick, worker_pool
from shard_tools.scan import LIMITS, Members, skip

_INDEXED = {name: kind.index for name, kind in KINDS.items() if kind.index is not None}  # the kinds indexed in place
# index_KIND(sources, out, **options): index_archives(KIND, ...) for each of them (module `__getattr__`)
__all__ = ["IndexSummary", "index_archives", *(f"index_{name}" for name in _INDEXED)]

log = logging.getLogger(__name__)
_READ_BLOCK = 16 << 20  # archives are read in blocks of this size


@dataclasses.dataclass
class IndexSummary:
    """What an index run did: samples indexed, archives read, inputs skipped (named) or ignored."""

    samples: int = 0
    archives: int = 0
    bytes: int = 0  # of the archives
    skipped: int = 0
    ignored: int = 0  # members that are no sample's (folders, other file types)
    seconds: float = 0.0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # kind-specific, e.g. masks
    skip_list: list[dict[str, str]] = dataclasses.field(default_factory=list)
    outside: list[str] = dataclasses.field(default_factory=list)  # folders outside OUT holding archives: to allow

    def lines(self) -> list[str]:
        extra = "".join(f", {v} {k}" for k, v in sorted(self.counts.items()))
        rate = self.bytes / self.seconds / 1e6 if self.seconds else 0.0
        lines = [f"indexed {self.samples} samples{extra} in {self.archives} archives, {self.bytes / 1e6:.1f} MB, "
                 f"in place (no copy); {self.ignored} other members ignored",
                 f"skipped {self.skipped}; {self.seconds:.1f} s, {rate:.1f} MB/s"]
        if self.outside:
            lines.append(f"the archives lie outside the dataset's folder, where a loader reads only what you allow: "
                         f"make_stream_loader(..., allowed_roots={self.outside!r}), shard-pack verify/tune/preview "
                         + " ".join(f"--allow-root {place}" for place in self.outside))
        return lines


@dataclasses.dataclass(frozen=True)
class _Scanned:
    """One archive, scanned: its samples (key, members) in order of their first member, what was skipped."""

    bytes: int
    sha256: str
    samples: list[tuple[str, Members]]
    skipped: list[dict[str, str]]
    ignored: int
    counts: dict[str, int]


def _scan(kind: str, url: str, storage_options: dict[str, Any] | None,
          check: Callable[[int], None] | None = None) -> _Scanned:
    """Read one archive front to back once: its samples, skipped inputs, SHA-256 and size. In a pool,
    `check(0)` before each read ends the scan once the pool is stopped."""
    indexing = _INDEXED[kind]
    fs, path = filesystem(url, storage_options)
    digest, size = hashlib.sha256(), 0
    try:  # (a local archive only if it is a regular file: a FIFO or a device is skipped, named)
        opened = os.fdopen(open_regular(path, url), "rb", _READ_BLOCK) if is_local(fs) else \
            fs.open(path, "rb", block_size=_READ_BLOCK)
    except FileNotFoundError as exc:
        raise InputError("archive is missing", url=url) from exc
    except ShardError as exc:
        return _Scanned(0, digest.hexdigest(), [], [{"source": url, "key": "", "reason": str(exc)}], 0, {})

    def read(n: int) -> bytes:
        nonlocal size
        if check is not None:
            check(0)
        data = f.read(n)
        digest.update(data)
        size += len(data)
        return data

    skipped: list[dict[str, str]] = []
    counts: collections.Counter[str] = collections.Counter()
    try:
        with opened as f:
            samples = indexing.samples(url, scan_archive(read, url, indexing.wanted, LIMITS), skipped, counts)
            while read(_READ_BLOCK):  # (what follows the end-of-archive blocks: hashed too)
                pass
    except FileNotFoundError as exc:
        raise InputError("archive is missing", url=url) from exc
    except ShardError as exc:  # (a data problem of the input: exit code 1)
        raise InputError(exc.message, url=exc.url) from exc
    ignored = counts.pop("ignored", 0)
    return _Scanned(size, digest.hexdigest(), samples, skipped, ignored, dict(counts))


def _archives(sources: Sequence[str], storage_options: dict[str, Any] | None) -> list[str]:
    """The `.tar` archives named or found (sorted) in folders, as URLs (local ones as absolute paths)."""
    found = []
    for source in sources:
        fs, path = filesystem(source, storage_options)
        url = (lambda p: p) if is_local(fs) else fs.unstrip_protocol
        if fs.isdir(path):
            found += [url(p) for p in sorted(fs.find(path)) if p.endswith(".tar")]
        elif path.endswith(".tar") and fs.isfile(path):
            found.append(url(path))
        elif path.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")):
            raise PackError(f"{source}: a compressed archive; only uncompressed .tar archives are indexed in place")
        else:
            raise FileNotFoundError(f"{source}: not a .tar archive or a folder")
    if len(set(found)) != len(found):
        raise PackError(f"archive {next(u for u in found if found.count(u) > 1)} is given twice")
    return found


def _name(url: str, out: str) -> str:
    """The archive's name in the manifest: relative to OUT when it sits under it, else its absolute path or URL."""
    prefix = out.rstrip("/") + "/"
    if url.startswith(prefix):
        with contextlib.suppress(ValueError):  # (a relative path of other characters: named whole instead)
            return check_shard_name(url[len(prefix) :], "indexed")
    return check_shard_name(url, "indexed")


def index_archives(kind: str, sources: Sequence[str], out: str, *,
                   splits: Sequence[tuple[str, float]] = (("train", 1.0),), workers: int = 1,
                   max_skipped: int = 10, progress: bool = True,
                   storage_options: dict[str, Any] | None = None, dask: str | None = None) -> IndexSummary:
    """Index the archives in `sources` in place into the dataset folder `out` (index files and the
    manifest, written last and atomically; nothing else). Raises PackError if `out` holds a dataset
    that was not indexed in place, TooManySkipped past `max_skipped` (as soon as an archive takes
    the count past it), and InputError naming the archive when one is missing or cannot be read as
    an uncompressed tar, or naming the input when it holds no archive or no sample; Interrupted on
    Ctrl-C. What the run wrote is removed then. Each archive's samples are written to its index
    files as it comes: memory grows with archives, and by 16 bytes a key (`SeenKeys`).

    `dask`: scan the archives on a Dask cluster (`tcp://host:8786`, or `local:N`), one task per
    archive, as the packers run their shards (`shard_tools.runners.dask_tasks`); the output is the same
    bytes. The workers read the archives themselves, with `storage_options`: on a real cluster they
    must reach them (object storage, or a shared filesystem). Only the scans run there: this process
    writes the index files and the manifest."""
    if kind not in _INDEXED:
        raise ConfigError(f"kind {kind!r} cannot be indexed in place; known: {sorted(_INDEXED)}")
    # (the options checked as packing checks them)
    options = PackOptions(splits=tuple(splits), workers=workers, max_skipped=max_skipped, dask=dask)
    started = time.monotonic()
    fs, base = filesystem(out, storage_options)
    out_url = base if is_local(fs) else fs.unstrip_protocol(base)
    earlier = _check_out(fs, base, out, storage_options)
    urls = _archives(sources, storage_options)
    if not urls:
        raise InputError("no .tar archives: nothing to index", url=", ".join(sources))
    made = is_local(fs) and not fs.exists(base)
    if is_local(fs):
        fs.makedirs(base, exist_ok=True)
    files = _IndexFiles(fs, base)
    try:
        names = [_name(u, out_url) for u in urls]
        summary, manifest = _index(kind, urls, names, options, storage_options, progress, files)
    except BaseException:
        for name in files.written:
            if name not in earlier:
                with contextlib.suppress(FileNotFoundError):  # (interrupted while it was written)
                    fs.rm_file(join(base, name))
        if made and fs.exists(base) and not fs.ls(base):
            fs.rmdir(base)
        raise
    write_bytes(fs, join(base, MANIFEST_NAME), manifest.to_json())  # last: the indexes it lists are in place
    for name in sorted(earlier - _listed(manifest)):  # the earlier run's indexes the manifest drops (nothing else)
        fs.rm_file(join(base, name))
    summary.seconds = time.monotonic() - started
    summary.outside = _outside(urls, out_url, is_local(fs))
    return summary


def _outside(urls: list[str], out: str, local: bool) -> list[str]:
    """The fewest folders outside `out` that hold the archives lying outside it (locally by real path,
    as a loader follows links): what a loader must be allowed to read (`allowed_roots`)."""
    folders = set()
    for url in urls:
        real = os.path.realpath(url) if local else url
        if not within(real, os.path.realpath(out) if local else out):
            folders.add(posixpath.dirname(real))
    return sorted(f for f in folders if not any(f != g and within(f, g) for g in folders))


def _map(kind: str, urls: list[str], options: PackOptions, storage_options: dict[str, Any] | None,
         bar: Progress) -> Iterator[_Scanned]:
    """Each archive scanned, in order (in a process pool when workers > 1; on Dask, each task as it
    finishes, held until those before it have come); `bar` counts the archives scanned."""
    if options.dask is not None:
        calls = [(_scan, kind, url, storage_options) for url in urls]
        finished: dict[int, _Scanned] = {}
        ahead = 0  # the next archive to yield
        with contextlib.closing(dask_tasks(options.dask, calls, [f"archive {url}" for url in urls],
                                           retries=options.task_retries)) as results:
            for position, scanned in results:
                bar.update(1)
                finished[position] = scanned
                while ahead in finished:
                    yield finished.pop(ahead)
                    ahead += 1
        return
    if options.workers == 1 or len(urls) <= 1:
        for url in urls:
            scanned = _scan(kind, url, storage_options)
            bar.update(1)
            yield scanned
        return
    calls = [(_scan, kind, url, storage_options, pool_tick) for url in urls]
    with worker_pool(min(options.workers, len(urls)), calls) as (futures, _):
        for future in futures:
            scanned = future.result()
            bar.update(1)
            yield scanned


def _check_out(fs: Any, base: str, out: str, storage_options: dict[str, Any] | None) -> set[str]:
    """OUT may hold anything (the archives themselves, say) but a dataset other than one indexed in
    place; the index files an earlier run listed there."""
    if not fs.exists(join(base, MANIFEST_NAME)):
        return set()
    existing = read_manifest(out, storage_options)
    if existing.origin != "indexed":
        raise PackError(f"{out} holds a packed dataset; index into another folder")
    return _listed(existing)


def _listed(manifest: Manifest) -> set[str]:
    """The index files a manifest lists."""
    return {shard.index.name for split in manifest.splits.values() for shard in split if shard.index is not None}


class SeenKeys:
    """The keys indexed so far, as 128-bit hashes (16 bytes a key, not a set of strings) in sorted
    runs, each at most half the one before (merged as they grow): `add` is O(k log n)."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def add(self, keys: Sequence[str]) -> np.ndarray:
        """Which of `keys` (distinct) were not seen before; all of them are seen now."""
        digests = np.array([hashlib.blake2b(k.encode(), digest_size=16).digest() for k in keys], dtype="S16")
        new = np.ones(len(digests), bool)
        for run in self.runs:
            at = np.minimum(np.searchsorted(run, digests), len(run) - 1)
            new &= run[at] != digests
        run = np.sort(digests[new])
        while run.size and self.runs and len(self.runs[-1]) <= 2 * len(run):
            run = np.concatenate([self.runs.pop(), run])
            run.sort()  # (in place: at most twice the keys' 16 bytes while merging)
        if run.size:
            self.runs.append(run)
        return new

    def __len__(self) -> int:
        return sum(len(run) for run in self.runs)


@dataclasses.dataclass
class _IndexFiles:
    """Where a run writes its index files (a filesystem and the dataset's folder on it), and the names
    of those it wrote (each named before it is written: removed if the run fails)."""

    fs: Any
    base: str
    written: list[str] = dataclasses.field(default_factory=list)

    def write(self, name: str, data: bytes) -> None:
        self.written.append(name)
        write_bytes(self.fs, join(self.base, name), data)


def _index(kind: str, urls: list[str], names: list[str], options: PackOptions, storage_options: dict[str, Any] | None,
           progress: bool, files: _IndexFiles) -> tuple[IndexSummary, Manifest]:
    """Each archive as it is scanned: keys seen in an earlier archive dropped (the first kept),
    samples split by key, its index files written (into `files`); then the manifest to write."""
    splits, max_skipped = options.splits, options.max_skipped
    assert splits is not None
    keys, skipped, exts = SeenKeys(), [], set()
    tables: dict[str, list[ShardInfo]] = {name: [] for name, _ in splits}
    archives, counts, ignored = [], collections.Counter(), 0
    bar = Progress(len(urls), progress, unit="archive", what="indexed %d/%d archives")
    try:
        with contextlib.closing(_map(kind, urls, options, storage_options, bar)) as scans:
            for number, (url, name, result) in enumerate(zip(urls, names, scans)):
                archives.append((result.bytes, result.sha256))
                counts.update(result.counts)
                ignored += result.ignored
                skipped += result.skipped
                by_split: dict[str, list[tuple[str, Members]]] = {}
                for (key, members), new in zip(result.samples, keys.add([key for key, _ in result.samples])):
                    if not new:
                        why = f"duplicate key {key!r} (in an earlier archive); kept the first"
                        skipped.append(skip(url, f"{key}.{members[0][0]}", key, why))
                        continue
                    by_split.setdefault(split_of(key, splits), []).append((key, members))
                    exts.update(ext for ext, _, _ in members)
                if len(skipped) > max_skipped:
                    skipped.sort(key=lambda s: (s["key"], s["source"]))
                    for s in skipped[:20]:
                        log.error("skipped %s", s["reason"])
                    where = "" if number + 1 == len(urls) else f" in the first {number + 1} of {len(urls)} archives"
                    raise TooManySkipped(f"{len(skipped)} samples skipped{where}, more than --max-skipped "
                                         f"{max_skipped}; nothing was written")
                for split, samples in by_split.items():
                    try:
                        built = ShardIndex.build([k for k, _ in samples], [1] * len(samples), [m for _, m in samples])
                    except ValueError as exc:
                        raise InputError(f"cannot be indexed: {exc}", url=url) from exc
                    data = built.to_bytes(result.bytes)
                    digest = hashlib.sha256(data).hexdigest()[:12]
                    index = f"{split}-{number:06d}-{digest}.idx"  # (never another run's file)
                    files.write(index, data)
                    tables[split].append(ShardInfo(name, len(samples), len(samples), result.bytes, result.sha256,
                                                   IndexInfo.of(name, data, index)))
    except KeyboardInterrupt as exc:
        raise Interrupted(f"interrupted after {len(archives)} of {len(urls)} archives; the index files of this run are "
                          "removed: run the same command to start again") from exc
    finally:
        bar.close()
    if not len(keys):
        why = f" ({len(skipped)} skipped, the first: {skipped[0]['reason']})" if skipped else ""
        more = f" and {len(urls) - 1} more archives" if len(urls) > 1 else ""
        raise InputError(f"no {kind} samples{why}: nothing to index", url=f"{urls[0]}{more}")
    skipped.sort(key=lambda s: (s["key"], s["source"]))
    stored = {"splits": [list(s) for s in splits]}
    fingerprint = hashlib.sha256(json.dumps([kind, stored, names, archives]).encode())
    manifest = Manifest(kind, tables, stored, fingerprint.hexdigest(), tuple(skipped), origin="indexed",
                        members=tuple(sorted(exts)))
    summary = IndexSummary(samples=len(keys), archives=len(urls), bytes=sum(b for b, _ in archives),
                           skipped=len(skipped), ignored=ignored, counts=dict(counts), skip_list=skipped)
    return summary, manifest


def __getattr__(name: str) -> Callable[..., IndexSummary]:
    """`index_KIND(sources, out, **options)`: `index_archives(KIND, sources, out, **options)`, for each
    kind that can be indexed in place (`index_sa1b`, ...)."""
    kind = name.removeprefix("index_")
    if not name.startswith("index_") or kind not in _INDEXED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def index_kind(sources: Sequence[str], out: str, **options: Any) -> IndexSummary:
        return index_archives(kind, sources, out, **options)

    index_kind.__name__ = index_kind.__qualname__ = name
    index_kind.__doc__ = f"`index_archives({kind!r}, ...)`: {_INDEXED[kind].what} (`shard-pack index {kind}`)."
    return index_kind
