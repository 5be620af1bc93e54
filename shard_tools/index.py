"""`shard-pack index`: make a dataset of original archives in place (SA-1B as Meta ships it, or any
WebDataset tars), writing only shard indexes and a manifest; the archives are never copied.

Each archive is read once, front to back in large blocks (its tar headers parsed, never extracted),
and its SHA-256 and size computed in the same pass; archives are scanned in parallel and the
output is byte-identical for any number of workers. SA-1B pairs are checked exactly as packing
checks them (`shard_tools.sa1b.check_pair`); a bad pair is skipped, named and counted. Samples go
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

from pipeline.errors import InputError, PackError, SampleError, ShardError, TooManySkipped
from pipeline.format import (MANIFEST_NAME, SA1B_JPG, SA1B_JSON, WEBDATASET, IndexInfo, Manifest, ShardIndex, ShardInfo,
                             check_ext, check_key, check_shard_name)
from pipeline.storage import filesystem, is_local, join, read_manifest, write_bytes
from pipeline.storage.local import open_regular
from pipeline.storage.places import within
from pipeline.tario import BLOCK, ArchiveMember, ReadLimits, scan_archive
from shard_tools.pack import Interrupted, PackOptions, split_of
from shard_tools.progress import Progress
from shard_tools.runners import dask_tasks, pool_tick, worker_pool
from shard_tools.sa1b import check_pair

__all__ = ["IndexSummary", "index_archives", "index_sa1b", "index_webdataset"]

log = logging.getLogger(__name__)
_READ_BLOCK = 16 << 20  # archives are read in blocks of this size
_LIMITS = ReadLimits()  # what the loader will accept of a sample: spans and member sizes beyond are skipped here
_Members = list[tuple[str, int, int]]  # (extension, header offset, size), in archive order


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
        lines = [f"indexed {self.samples} samples{extra} in {self.archives} archives, {self.bytes / 1e6:.1f} MB, in place "
                 f"(no copy); {self.ignored} other members ignored",
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
    samples: list[tuple[str, _Members]]
    skipped: list[dict[str, str]]
    ignored: int
    counts: dict[str, int]


def _skip(url: str, member: str, key: str, reason: str) -> dict[str, str]:
    return {"source": f"{url}:{member}", "key": key, "reason": f"{url}:{member}: {reason}"}


def _members(url: str, scanned: Iterator[ArchiveMember], skipped: list[dict[str, str]],
             counts: dict[str, int]) -> Iterator[tuple[ArchiveMember, str, str]]:
    """(member, key, extension) of each regular file with a flat name; the rest skipped or ignored."""
    for member in scanned:
        name = member.name.removeprefix("./")
        key, dot, ext = name.partition(".")
        if member.directory:
            counts["ignored"] += 1
        elif member.problem is not None or "/" in name or not dot:
            why = member.problem or ("in a folder inside the archive: only flat names are indexed" if "/" in name
                                     else "no extension")
            skipped.append(_skip(url, member.name, key, why))
        else:
            yield member, key, ext


def _sa1b_samples(url: str, scanned: Iterator[ArchiveMember], skipped: list[dict[str, str]],
                  counts: dict[str, int]) -> list[tuple[str, _Members]]:
    """Each archive's jpg/json pairs, wherever in the archive either lies, checked as packing checks them."""
    pending: dict[str, dict[str, ArchiveMember]] = {}  # the member whose partner has not come yet
    held, done, samples = 0, set(), []
    for member, key, ext in _members(url, scanned, skipped, counts):
        if ext not in (SA1B_JPG, SA1B_JSON):
            counts["ignored"] += 1
            continue
        try:
            check_key(key)
        except ValueError as exc:
            skipped.append(_skip(url, member.name, key, str(exc)))
            continue
        entry = pending.setdefault(key, {}) if key not in done else {}
        if key in done or ext in entry:
            skipped.append(_skip(url, member.name, key, f"duplicate key {key!r} in this archive; kept the first"))
            continue
        entry[ext] = member
        held += member.size
        if held > _LIMITS.max_sample_bytes:
            raise ShardError(url, f"more than {_LIMITS.max_sample_bytes} bytes of members wait for their pair at "
                             f"{member.name!r}: the archive's samples are not kept together")
        if len(entry) == 2:
            del pending[key]
            done.add(key)
            held -= sum(m.size for m in entry.values())
            sample = _sa1b_pair(url, key, entry, skipped)
            if sample is not None:
                samples.append(sample)
                counts["masks"] += sample[2]
    for key, entry in pending.items():
        (ext, member), = entry.items()
        missing = "JSON" if ext == SA1B_JPG else "image"
        skipped.append(_skip(url, member.name, key, f"no {missing} for key {key!r} in this archive"))
    return [(key, members) for key, members, _ in sorted(samples, key=lambda s: s[1][0][1])]


def _sa1b_pair(url: str, key: str, entry: dict[str, ArchiveMember],
               skipped: list[dict[str, str]]) -> tuple[str, _Members, int] | None:
    """(key, members, masks) of a pair that packing would accept, else None (the reason skipped)."""
    jpg, meta = entry[SA1B_JPG], entry[SA1B_JSON]
    members = sorted([(ext, m.offset, m.size) for ext, m in entry.items()], key=lambda m: m[1])
    end = members[-1][1] + BLOCK + members[-1][2]
    if end - members[0][1] > _LIMITS.max_sample_bytes:
        skipped.append(_skip(url, meta.name, key, f"the pair lies {end - members[0][1]} bytes apart, more than "
                             f"max_sample_bytes={_LIMITS.max_sample_bytes}"))
        return None
    assert jpg.data is not None and meta.data is not None
    try:
        record, _ = check_pair(jpg.data, meta.data, f"{url}:{jpg.name}", f"{url}:{meta.name}", key)
    except SampleError as exc:
        skipped.append({"source": exc.url, "key": key, "reason": str(exc)})
        return None
    return key, members, len(record["counts"])


def _webdataset_samples(url: str, scanned: Iterator[ArchiveMember], skipped: list[dict[str, str]],
                        counts: dict[str, int]) -> list[tuple[str, _Members]]:
    """Consecutive members of one key form a sample, as webdataset groups them (the key: the member's
    path up to its basename's first dot, a `./` prefix dropped); a sample holding a member that
    cannot be indexed is skipped whole, named."""
    groups: list[tuple[str, list[ArchiveMember]]] = []
    for member in scanned:
        name = member.name.removeprefix("./")
        base, dot, _ = posixpath.basename(name).partition(".")
        if member.directory or not dot:
            counts["ignored"] += 1
            continue
        key = posixpath.join(posixpath.dirname(name), base)
        if not groups or groups[-1][0] != key:
            groups.append((key, []))
        groups[-1][1].append(member)
    samples: list[tuple[str, _Members]] = []
    seen: set[str] = set()
    for key, group in groups:
        members = [(m.name.removeprefix("./").partition(".")[2], m.offset, m.size) for m in group]
        reason = _webdataset_problem(key, group, [ext for ext, _, _ in members], seen)
        seen.add(key)
        if reason:
            skipped.append(_skip(url, group[0].name, key, reason))
        else:
            samples.append((key, members))
    return samples


def _webdataset_problem(key: str, group: list[ArchiveMember], exts: list[str], seen: set[str]) -> str | None:
    """Why a group of members cannot be indexed as a sample, if so."""
    for member, ext in zip(group, exts):
        if member.problem is not None:
            return f"member {member.name!r}: {member.problem}"
        if not _ext_ok(ext):
            return f"member {member.name!r}: extension {ext!r} is not lowercase letters and digits, joined by dots"
    try:
        check_key(key)
    except ValueError as exc:
        return str(exc)
    if len(set(exts)) != len(exts):
        return f"a member extension twice in one sample: {exts}"
    if key in seen:
        return f"duplicate key {key!r} (its members are not consecutive); kept the first"
    if len(group) > _LIMITS.max_members:
        return f"more than {_LIMITS.max_members} members"
    return None


def _ext_ok(ext: str) -> bool:
    try:
        check_ext(ext)
    except ValueError:
        return False
    return True


_KINDS: dict[str, tuple[Callable[..., list[tuple[str, _Members]]], Callable[[str], bool]]] = {
    "sa1b": (_sa1b_samples, lambda name: name.endswith((f".{SA1B_JPG}", f".{SA1B_JSON}"))),
    WEBDATASET: (_webdataset_samples, lambda name: False),  # (headers only: the user's decode checks the bytes)
}


def _scan(kind: str, url: str, storage_options: dict[str, Any] | None,
          check: Callable[[int], None] | None = None) -> _Scanned:
    """Read one archive front to back once: its samples, skipped inputs, SHA-256 and size. In a pool,
    `check(0)` before each read ends the scan once the pool is stopped."""
    group, wanted = _KINDS[kind]
    fs, path = filesystem(url, storage_options)
    digest, size = hashlib.sha256(), 0
    try:  # (a local archive only if it is a regular file: a FIFO or a device is skipped, named)
        opened = os.fdopen(open_regular(path, url), "rb", _READ_BLOCK) if is_local(fs) else \
            fs.open(path, "rb", block_size=_READ_BLOCK)
    except FileNotFoundError as exc:
        raise InputError(url, "archive is missing") from exc
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
            samples = group(url, scan_archive(read, url, wanted, _LIMITS), skipped, counts)
            while read(_READ_BLOCK):  # (what follows the end-of-archive blocks: hashed too)
                pass
    except FileNotFoundError as exc:
        raise InputError(url, "archive is missing") from exc
    except ShardError as exc:  # (a data problem of the input: exit code 1)
        raise InputError(exc.url, exc.message) from exc
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


def index_archives(kind: str, sources: Sequence[str], out: str, *, splits: Sequence[tuple[str, float]] = (("train", 1.0),),
                   workers: int = 1, max_skipped: int = 10, progress: bool = True,
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
    if kind not in _KINDS:
        raise ValueError(f"kind {kind!r} cannot be indexed in place; known: {sorted(_KINDS)}")
    options = PackOptions(splits=tuple(splits), workers=workers, max_skipped=max_skipped, dask=dask)  # (checked as packing does)
    started = time.monotonic()
    fs, base = filesystem(out, storage_options)
    out_url = base if is_local(fs) else fs.unstrip_protocol(base)
    earlier = _check_out(fs, base, out, storage_options)
    urls = _archives(sources, storage_options)
    if not urls:
        raise InputError(", ".join(sources), "no .tar archives: nothing to index")
    made = is_local(fs) and not fs.exists(base)
    if is_local(fs):
        fs.makedirs(base, exist_ok=True)
    written: list[str] = []
    try:
        summary, manifest = _index(kind, urls, [_name(u, out_url) for u in urls], options, storage_options, fs, base,
                                   progress, written)
    except BaseException:
        for name in written:
            if name not in earlier:
                with contextlib.suppress(FileNotFoundError):  # (interrupted while it was written)
                    fs.rm_file(join(base, name))
        if made and fs.exists(base) and not fs.ls(base):
            fs.rmdir(base)
        raise
    write_bytes(fs, join(base, MANIFEST_NAME), manifest.to_json())  # last: the indexes it lists are in place
    for name in sorted(earlier - _listed(manifest)):  # the earlier run's indexes no manifest lists now (and nothing else)
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


def _index(kind: str, urls: list[str], names: list[str], options: PackOptions, storage_options: dict[str, Any] | None,
           fs: Any, base: str, progress: bool, written: list[str]) -> tuple[IndexSummary, Manifest]:
    """Each archive as it is scanned: keys seen in an earlier archive dropped (the first kept),
    samples split by key, its index files written (named in `written`); then the manifest to write."""
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
                by_split: dict[str, list[tuple[str, _Members]]] = {}
                for (key, members), new in zip(result.samples, keys.add([key for key, _ in result.samples])):
                    if not new:
                        skipped.append(_skip(url, f"{key}.{members[0][0]}", key, f"duplicate key {key!r} (in an earlier "
                                             "archive); kept the first"))
                        continue
                    by_split.setdefault(split_of(key, splits), []).append((key, members))
                    exts.update(ext for ext, _, _ in members)
                if len(skipped) > max_skipped:
                    skipped.sort(key=lambda s: (s["key"], s["source"]))
                    for s in skipped[:20]:
                        log.error("skipped %s", s["reason"])
                    where = "" if number + 1 == len(urls) else f" in the first {number + 1} of {len(urls)} archives"
                    raise TooManySkipped(f"{len(skipped)} samples skipped{where}, more than --max-skipped {max_skipped}; "
                                         "nothing was written")
                for split, samples in by_split.items():
                    try:
                        built = ShardIndex.build([k for k, _ in samples], [1] * len(samples), [m for _, m in samples])
                    except ValueError as exc:
                        raise InputError(url, f"cannot be indexed: {exc}") from exc
                    data = built.to_bytes(result.bytes)
                    index = f"{split}-{number:06d}-{hashlib.sha256(data).hexdigest()[:12]}.idx"  # (never another run's file)
                    written.append(index)
                    write_bytes(fs, join(base, index), data)
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
        raise InputError(f"{urls[0]}{more}", f"no {kind} samples{why}: nothing to index")
    skipped.sort(key=lambda s: (s["key"], s["source"]))
    stored = {"splits": [list(s) for s in splits]}
    fingerprint = hashlib.sha256(json.dumps([kind, stored, names, archives]).encode())
    manifest = Manifest(kind, tables, stored, fingerprint.hexdigest(), tuple(skipped), origin="indexed",
                        members=tuple(sorted(exts)))
    summary = IndexSummary(samples=len(keys), archives=len(urls), bytes=sum(b for b, _ in archives), skipped=len(skipped),
                           ignored=ignored, counts=dict(counts), skip_list=skipped)
    return summary, manifest


def index_sa1b(sources: Sequence[str], out: str, **options: Any) -> IndexSummary:
    """`index_archives("sa1b", ...)`: SA-1B archives as Meta ships them (`sa_<id>.jpg` + `sa_<id>.json`)."""
    return index_archives("sa1b", sources, out, **options)


def index_webdataset(sources: Sequence[str], out: str, **options: Any) -> IndexSummary:
    """`index_archives("webdataset", ...)`: any WebDataset tars (members grouped by key)."""
    return index_archives(WEBDATASET, sources, out, **options)
