"""pipeline.tario as a module: what ShardWriter writes, parse_sample and sample_members read back."""

from __future__ import annotations

import hashlib
import io
import random
import string
import tarfile

import pytest

from pipeline.errors import ShardError
from pipeline.tario import BLOCK, ReadLimits, ShardWriter, parse_sample, sample_members, scan_archive

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


def _longest_shared(message: str, secret: str) -> int:
    """The length of the longest run of characters of `secret` that `message` quotes."""
    best = 0
    for i in range(len(secret)):
        while i + best < len(secret) and secret[i : i + best + 1] in message:
            best += 1
    return best


def _header(name: bytes, size_field: bytes) -> bytes:
    """A tar header of a regular file with these raw name and size fields, its checksum right."""
    header = bytearray(BLOCK)
    header[: len(name)] = name
    header[100:108], header[124:136], header[156:157], header[257:263] = b"0000644\0", size_field, b"0", b"ustar\0"
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    return bytes(header)


SECRET = "".join(random.Random(5).choice(string.ascii_uppercase + string.digits) for _ in range(BLOCK))


@pytest.mark.parametrize("case", ["whole block", "size field", "member name", "recorded member name"])
def test_errors_name_the_byte_and_never_quote_the_bytes(case):
    """A sample range over a file that is not a shard (a crafted index over any file): the error says
    where, and quotes none of the file's bytes (before: 'bad octal field b'RET-LINE'', 120 characters
    of a member name)."""
    secret = SECRET.encode()
    data, members = {
        "whole block": (secret, None),
        "size field": (_header(b"a.jpg", b"RET-LINE\0\0\0\0"), None),
        "member name": (_header(secret[:100], b"00000000000\0") + bytes(BLOCK), None),
        "recorded member name": (_header(secret[:100], b"00000000000\0") + bytes(BLOCK), [("jpg", 4096, 0)]),
    }[case]
    with pytest.raises(ShardError) as info:
        parse_sample(data, "s.tar", "a", members=members, start=4096 if members else 0)
    message = str(info.value)
    assert message.startswith("s.tar: sample 'a': ") and "byte " in message
    assert "RET-LINE" not in message and _longest_shared(message, SECRET) <= 3, message


def test_a_pax_header_setting_only_the_size_names_its_member():
    """Its member is reported (and skipped) by its own name, not as '././@PaxHeader'."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("k.bin")
        info.size, info.pax_headers = 5, {"size": "5"}
        tar.addfile(info, io.BytesIO(b"hello"))
        tar.addfile(tarfile.TarInfo("plain.txt"), io.BytesIO(b""))
    members = list(scan_archive(io.BytesIO(out.getvalue()).read, "w.tar", lambda name: True))
    assert [(m.name, m.problem is not None) for m in members] == [("k.bin", True), ("plain.txt", False)]
    assert "extended header" in members[0].problem
