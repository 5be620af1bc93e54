"""pipeline.tario as a module: what ShardWriter writes, parse_sample and sample_members read back."""

from __future__ import annotations

import hashlib
import tarfile

import pytest

from pipeline.errors import ShardError
from pipeline.tario import BLOCK, ReadLimits, ShardWriter, parse_sample, sample_members

SAMPLES = {"a": [("jpg", b"\xff\xd8" + b"x" * 700), ("msgpack", b"\x80")], "b-2": [("bin", b""), ("txt", b"y" * 512)]}


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "s.tar"
    writer = ShardWriter(str(path))
    for key, members in SAMPLES.items():
        writer.add(key, members)
    digest = writer.close()
    return path, writer, digest


def test_writer_output_is_a_plain_tar_and_its_digest(shard):
    path, writer, digest = shard
    data = path.read_bytes()
    assert digest == hashlib.sha256(data).hexdigest() and len(data) == writer.size and len(data) % BLOCK == 0
    with tarfile.open(path) as tar:
        assert tar.getnames() == [f"{key}.{ext}" for key, members in SAMPLES.items() for ext, _ in members]
    assert not list(path.parent.glob("*.partial-*"))


def test_parse_sample_round_trip(shard):
    path, writer, _ = shard
    data = path.read_bytes()
    starts = [members[0][1] for members in writer.members] + [len(data) - 2 * BLOCK]
    for (key, members), start, end in zip(SAMPLES.items(), starts, starts[1:]):
        parsed = parse_sample(data[start:end], "s.tar", key)
        assert {ext: bytes(view) for ext, view in parsed.items()} == dict(members)


def test_sample_members_are_the_writers_offsets(shard):
    path, writer, _ = shard
    data = path.read_bytes()
    start, end = writer.members[1][0][1], len(data) - 2 * BLOCK
    found = sample_members(data[start:end], "s.tar", "b-2")
    assert found == [(ext, at - start, size) for ext, at, size in writer.members[1]]
    assert writer.keys == list(SAMPLES)


def test_parse_sample_refusals(shard):
    path, writer, _ = shard
    data = bytearray(path.read_bytes())
    end = writer.members[1][0][1]
    with pytest.raises(ShardError, match="s.tar: .*'b'"):
        parse_sample(bytes(data[:end]), "s.tar", "b")  # another sample's members
    with pytest.raises(ShardError, match="unsafe sample key"):
        parse_sample(bytes(data[:end]), "s.tar", "../a")
    with pytest.raises(ShardError, match="gzip"):
        parse_sample(b"\x1f\x8b" + bytes(data[2:end]), "s.tar", "a")
    with pytest.raises(ShardError, match="truncated"):
        parse_sample(bytes(data[: BLOCK - 1]), "s.tar", "a")
    data[100] ^= 1  # inside the first header's mode field: checksum no longer matches
    with pytest.raises(ShardError, match="checksum"):
        parse_sample(bytes(data[:end]), "s.tar", "a")
    with pytest.raises(ShardError):
        parse_sample(path.read_bytes()[:end], "s.tar", "a", ReadLimits(max_member_bytes=100))


def test_writer_refusals_and_abort(tmp_path):
    writer = ShardWriter(str(tmp_path / "s.tar"))
    with pytest.raises(ValueError, match="no members"):
        writer.add("a", [])
    with pytest.raises(ValueError, match="invalid member extension"):
        writer.add("a", [("../x", b"")])
    with pytest.raises(ValueError, match="invalid sample key"):
        writer.add("a/b", [("x", b"")])
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_read_limits_validate():
    with pytest.raises(ValueError, match="max_members must be a positive int"):
        ReadLimits(max_members=0)
    with pytest.raises(ValueError, match="max_image_pixels"):
        ReadLimits(max_image_pixels=True)
