"""Fuzzing the reader, the shard index and the SA-1B decoder: mutated shards give valid samples or the project's
own errors, never another exception, never a hang. `make fuzz` runs it longer."""

from __future__ import annotations

import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import ShardIndexError, ShardstreamError
from pipeline.format import ShardIndex
from pipeline.kinds.sa1b import Sa1b, Sa1bOptions
from pipeline.tario import BLOCK, parse_sample
from test_hostile import _member
from test_index import _index

OPTIONS = Sa1bOptions(image_size=32, mask_size=8, max_masks=4)


def _mutate(data: bytes, draw) -> bytes:
    """A few random edits (overwrite, insert, delete, truncate) aimed anywhere or at one region."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        if not out:
            break
        op = draw(st.sampled_from(["set", "set", "insert", "delete", "truncate", "header"]))
        at = draw(st.integers(0, len(out) - 1))
        if op == "set":
            out[at] = draw(st.integers(0, 255))
        elif op == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif op == "delete":
            del out[at : at + draw(st.integers(1, 512))]
        elif op == "truncate":
            del out[at:]
        else:  # a tar header field: name, mode, size, checksum, type, magic
            field = draw(st.sampled_from([(0, 100), (100, 8), (124, 12), (148, 8), (156, 1), (257, 6)]))
            start = (at // BLOCK) * BLOCK + field[0]
            out[start : start + field[1]] = draw(st.binary(min_size=field[1], max_size=field[1]))
    return bytes(out)


_PEAK = 64 << 20  # bytes of memory (numpy's and Python's) one input may take: far above a real sample's need


def _check(data: bytes, key: str) -> None:
    """Decoded or refused by name, within a bound of memory (measured, not timed: no input may make
    the decoder allocate by what its bytes claim, a huge image or mask, rather than by what they hold)."""
    tracemalloc.start()
    try:
        members = parse_sample(data, "fuzz.tar", key)
        sample = Sa1b(OPTIONS).decode(members, seed=0, epoch=0, url="fuzz.tar", key=key)
        assert sample["image"].shape[0] == 3 and sample["masks_packed"].dtype.name == "uint8"
    except ShardstreamError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < _PEAK, f"{peak} bytes for one input"


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_mutated_sample_bytes(sa1b_sample, data):
    key, raw, _, _ = sa1b_sample
    _check(_mutate(raw, data.draw), key)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_mutated_annotation_record(sa1b_sample, data):
    """The JPEG stays valid so the decoder gets to the msgpack record every time."""
    key, _, jpg, ann = sa1b_sample
    _check(_member(f"{key}.jpg", jpg) + _member(f"{key}.msgpack", _mutate(ann, data.draw)), key)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_index_is_parsed_exactly_or_refused(data):
    """Fuzz: any mutation either parses to an index whose entries stay in bounds, or is refused."""
    raw = bytearray(_index().to_bytes(8192))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    try:
        index = ShardIndex.from_bytes(bytes(raw), "i.idx", samples=3, units=6, shard_bytes=8192)
    except ShardIndexError:
        return
    assert (index.spans[:, 1] <= 8192).all() and (index.spans[:, 0] < index.spans[:, 1]).all()
    assert all(key for key in index.key_list())
