"""The shard index (`ShardIndex`): where each sample of one shard lies, stored beside the shard as a
small binary file (`<shard>.idx`, `index_name`) that a reader fetches when it first touches the
shard. Any change to its bytes bumps `INDEX_VERSION`."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from pipeline.errors import ConfigError, DatasetError, ShardIndexError
from pipeline.format.names import _EXT_RE, _KEY_BYTES

__all__ = ["INDEX_EXT", "INDEX_VERSION", "INDEX_MAGIC", "MAX_INDEX_SAMPLES", "MAX_INDEX_BYTES", "BLOCK_BYTES",
           "ShardIndex", "index_name"]

# The shard index file (`ShardIndex.to_bytes`), little-endian: a header (magic, version, flags 0,
# samples n, members m, key bytes, extension-table bytes, the shard's bytes, units), then
# spans u64[n, 2], member header offsets u64[m], member sizes u64[m], units u32[n], key ends
# u32[n], member ends u32[n], member extension numbers u8[m], the keys, the extensions ("\n"-joined).
INDEX_EXT = ".idx"
INDEX_VERSION = 1
INDEX_MAGIC = b"SSINDEX\n"
_INDEX_HEADER = struct.Struct("<8sIIQQQQQQ")
MAX_INDEX_SAMPLES = 1 << 24
MAX_INDEX_BYTES = 1 << 30
_MAX_MEMBERS = 16  # per sample
BLOCK_BYTES = 512  # a tar block


def _padded(size: int) -> int:
    return size + (-size % BLOCK_BYTES)


def index_name(shard: str) -> str:
    """The index file of a shard this project packs: `train-000000.tar` -> `train-000000.idx`."""
    return shard.removesuffix(".tar") + INDEX_EXT


class ShardIndex:
    """Where each sample of one shard lies: its key, its units, its byte span (its first member's
    header to its last member's padded end) and each member's header offset, size and extension.

    Stored beside the dataset as a small binary file (`to_bytes`), read by a worker when it first
    touches the shard. Members are recorded one by one, so an index can also describe archives
    whose samples' members are not adjacent. `members=None` marks an index made in memory from a
    schema-2 manifest, which recorded sample offsets only."""

    def __init__(self, keys: bytes, key_ends: np.ndarray, spans: np.ndarray, units: np.ndarray,
                 members: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
                 exts: tuple[str, ...] = ()) -> None:
        self.keys, self.key_ends, self.spans, self.units = keys, key_ends, spans, units
        self.members, self.exts = members, exts  # members: (ends per sample, header offsets, sizes, ext numbers)
        # each sample's first unit, then the count
        self.unit_starts = np.concatenate(([0], np.cumsum(units))).astype(np.int64)

    @property
    def samples(self) -> int:
        return len(self.units)

    @property
    def nbytes(self) -> int:
        arrays = [self.key_ends, self.spans, self.units, self.unit_starts, *(self.members or ())]
        return len(self.keys) + sum(a.nbytes for a in arrays)

    def key(self, i: int) -> str:
        return self.keys[(int(self.key_ends[i - 1]) if i else 0) : int(self.key_ends[i])].decode()

    def key_list(self) -> list[str]:
        starts = [0, *self.key_ends[:-1].tolist()]
        return [self.keys[a:b].decode() for a, b in zip(starts, self.key_ends.tolist())]

    def span(self, i: int) -> tuple[int, int]:
        start, end = self.spans[i].tolist()
        return start, end

    def sample_members(self, i: int) -> list[tuple[str, int, int]]:
        """(extension, header offset, data bytes) of each member of sample `i`, in shard order."""
        if self.members is None:
            raise DatasetError("this index does not record members (made from a schema-2 manifest)")
        ends, offsets, sizes, exts = self.members
        mine = slice(int(ends[i - 1]) if i else 0, int(ends[i]))
        found = zip(exts[mine].tolist(), offsets[mine].tolist(), sizes[mine].tolist())
        return [(self.exts[e], o, s) for e, o, s in found]

    @classmethod
    def build(cls, keys: Sequence[str], units: Sequence[int],
              members: Sequence[Sequence[tuple[str, int, int]]]) -> ShardIndex:
        """The index of samples given as key, units and members (extension, header offset, data bytes)."""
        exts = tuple(sorted({ext for sample in members for ext, _, _ in sample}))
        if len(exts) > 256 or len("\n".join(exts)) > 4096:  # (what `from_bytes` reads back)
            raise DatasetError(f"{len(exts)} distinct member extensions: an index holds at most 256, "
                               "in 4096 bytes")
        number = {ext: i for i, ext in enumerate(exts)}
        flat = [m for sample in members for m in sample]
        offsets = np.asarray([o for _, o, _ in flat], dtype=np.int64)
        sizes = np.asarray([s for _, _, s in flat], dtype=np.int64)
        ends = np.cumsum([len(sample) for sample in members], dtype=np.int64)
        spans = np.asarray([[sample[0][1], sample[-1][1] + BLOCK_BYTES + _padded(sample[-1][2])] for sample in members],
                           dtype=np.int64).reshape(-1, 2)
        encoded = [k.encode() for k in keys]
        return cls(b"".join(encoded), np.cumsum([len(k) for k in encoded], dtype=np.int64), spans,
                   np.asarray(units, dtype=np.int64),
                   (ends, offsets, sizes, np.asarray([number[e] for e, _, _ in flat], dtype=np.uint8)), exts)

    def to_bytes(self, shard_bytes: int) -> bytes:
        """The index file: a fixed header, then the arrays and the key and extension tables (little-endian)."""
        if self.members is None:
            raise ConfigError("an index without members cannot be written")
        ends, offsets, sizes, exts = self.members
        ext_table = "\n".join(self.exts).encode()
        header = _INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, 0, self.samples, len(offsets), len(self.keys),
                                    len(ext_table), shard_bytes, int(self.units.sum()))
        return b"".join([header, self.spans.astype("<u8").tobytes(), offsets.astype("<u8").tobytes(),
                         sizes.astype("<u8").tobytes(), self.units.astype("<u4").tobytes(),
                         self.key_ends.astype("<u4").tobytes(), ends.astype("<u4").tobytes(),
                         exts.astype("u1").tobytes(), self.keys, ext_table])

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, url: str, *, samples: int, units: int,
                   shard_bytes: int) -> ShardIndex:
        """Parse and check an index file against what the manifest says of its shard; IndexError
        (a ShardIndexError) naming the file on anything that is not exactly what `to_bytes` writes."""
        def bad(message: str) -> ShardIndexError:
            return ShardIndexError(f"invalid shard index: {message}", url=url)

        if len(data) < _INDEX_HEADER.size:
            raise bad(f"{len(data)} bytes, shorter than its header")
        magic, version, flags, n, m, key_bytes, ext_bytes, total, unit_count = _INDEX_HEADER.unpack_from(data)
        if magic != INDEX_MAGIC or version != INDEX_VERSION or flags:
            raise bad(f"not a version-{INDEX_VERSION} shardstream index (magic {magic!r}, version {version})")
        if (n, unit_count, total) != (samples, units, shard_bytes):
            raise bad(f"{n} samples, {unit_count} units, shard of {total} bytes; the manifest says {samples}, {units}, "
                      f"{shard_bytes}")
        if n > MAX_INDEX_SAMPLES or m > n * _MAX_MEMBERS or m < n or key_bytes > 80 * n or ext_bytes > 4096:
            raise bad(f"sizes out of bounds ({n} samples, {m} members, {key_bytes} key bytes, "
                      f"{ext_bytes} extension bytes)")
        needed = _INDEX_HEADER.size + 28 * n + 17 * m + key_bytes + ext_bytes
        if len(data) != needed:
            raise bad(f"{len(data)} bytes, the header's counts need {needed}")
        pos = _INDEX_HEADER.size

        def take(dtype: str, count: int) -> np.ndarray:
            nonlocal pos
            array = np.frombuffer(data, dtype, count, pos)
            pos += array.nbytes
            return array.astype(np.int64)

        spans, offsets, sizes = take("<u8", 2 * n).reshape(n, 2), take("<u8", m), take("<u8", m)
        unit_array, key_ends, ends, ext_numbers = take("<u4", n), take("<u4", n), take("<u4", n), take("u1", m)
        keys, ext_table = bytes(data[pos : pos + key_bytes]), bytes(data[pos + key_bytes :])
        exts = tuple(ext_table.decode("ascii", "replace").split("\n")) if ext_bytes else ()
        lengths = np.diff(key_ends, prepend=0)
        if (lengths < 1).any() or (lengths > 80).any() or (n and key_ends[-1] != key_bytes) or \
                not _KEY_BYTES[np.frombuffer(keys, np.uint8)].all():
            raise bad("keys must be 1-80 of [A-Za-z0-9_-] each, filling the key table")
        if (unit_array < 1).any():
            raise bad("a sample with no units")
        well_formed = len(set(exts)) == len(exts) and all(_EXT_RE.fullmatch(e) for e in exts)
        if not well_formed or (ext_numbers >= len(exts)).any():
            raise bad(f"invalid extension table {exts!r}"[:200])
        if n and ((spans[:, 0] >= spans[:, 1]).any() or spans[:, 1].max() > total or (np.diff(spans[:, 0]) <= 0).any()):
            raise bad("sample spans out of order, empty or past the shard's end")
        counts = np.diff(ends, prepend=0)
        if (counts < 1).any() or (n and ends[-1] != m) or (counts > _MAX_MEMBERS).any():
            raise bad("every sample needs 1 to 16 members, filling the member table")
        sample = np.repeat(np.arange(n), counts)
        member_end = offsets + BLOCK_BYTES + sizes + (-sizes % BLOCK_BYTES)
        same = sample[1:] == sample[:-1]
        if m and ((offsets < spans[sample, 0]) | (member_end > spans[sample, 1])).any() or \
                (same & (offsets[1:] < member_end[:-1])).any() or \
                len(np.unique(sample * 256 + ext_numbers)) != m:
            raise bad("members out of order, overlapping, outside their sample's span or repeated")
        return cls(keys, key_ends, spans, unit_array, (ends, offsets, sizes, ext_numbers.astype(np.uint8)), exts)

    @classmethod
    def of_offsets(cls, keys: Sequence[str], offsets: Sequence[int], units: Sequence[int] | None) -> ShardIndex:
        """A schema-2 shard entry (keys, sample offsets, units) as an index without members."""
        encoded = [k.encode() for k in keys]
        bounds = np.asarray(offsets, dtype=np.int64)
        return cls(b"".join(encoded), np.cumsum([len(k) for k in encoded], dtype=np.int64),
                   np.stack([bounds[:-1], bounds[1:]], axis=1),
                   np.asarray(units if units is not None else [1] * len(keys), dtype=np.int64))

