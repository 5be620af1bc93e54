"""Shards are untrusted: hostile and broken shards are refused with a named error, without side
effects and without memory blow-up. The corpus is generated here."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import pickle
import random
import string
import subprocess
import sys
import tarfile
import zlib

import msgpack
import pytest
from PIL import Image

from pipeline import ManifestError, ShardstreamError, make_stream_loader
from pipeline.tario import BLOCK

SMALL = dict(image_size=32, mask_size=8, max_masks=2)
PWNED = pathlib.Path("/tmp/shardstream-pwned")  # what the pickle payload would create if it ran


class _Payload:
    def __reduce__(self):
        return (open, (str(PWNED), "w"))


def _member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE, linkname: str = "", size: int | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, linkname, len(data) if size is None else size
    header = info.tobuf(format=tarfile.GNU_FORMAT)  # GNU: also takes long names and huge sizes
    return header + data + b"\0" * (-len(data) % BLOCK)


def _raw_header(name: str, size_field: bytes) -> bytes:
    """A USTAR header written by hand, with any size field (and a valid checksum)."""
    header = bytearray(_member(name, b"")[:BLOCK])
    assert len(size_field) == 12
    header[124:136] = size_field
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def _dataset(root: pathlib.Path, samples: list[tuple[str, bytes]], tail: bytes | None = b"\0" * 1024) -> str:
    """A dataset folder: one shard holding `samples` (key, raw bytes) and a manifest describing them;
    `tail=None` cuts the shard in the middle of its last sample (the manifest still lists it whole)."""
    root.mkdir(parents=True)
    data = b"".join(raw for _, raw in samples) + (tail or b"")
    offsets, pos = [], 0
    for _, raw in samples:
        offsets.append(pos)
        pos += len(raw)
    offsets.append(pos)
    (root / "train-000000.tar").write_bytes(data if tail is not None else data[: offsets[-2] + (pos - offsets[-2]) // 2])
    # A schema-2 manifest: it lists the hostile samples' byte ranges without an index file, whose
    # own hostile forms have tests of their own (test_index.py); the reader takes the same path.
    shard = {"name": "train-000000.tar", "samples": len(samples), "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest(), "keys": [k for k, _ in samples], "offsets": offsets}
    manifest = {"format": "shardstream", "schema_version": 2, "kind": "sa1b", "fingerprint": "hostile", "options": {},
                "skipped": [], "splits": {"train": {"samples": len(samples), "shards": [shard]}}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return str(root)


def _bomb_jpeg(jpg: bytes, width: int, height: int) -> bytes:
    """The JPEG with its frame header claiming width x height pixels."""
    data = bytearray(jpg)
    sof = next(i for i in range(len(data) - 1) if data[i] == 0xFF and data[i + 1] in (0xC0, 0xC1, 0xC2))
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def _gzip_bomb() -> bytes:
    """1 GB of zeros, gzip-compressed to about 1 MB."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = b"\0" * (1 << 20)
    return b"".join(packer.compress(zeros) for _ in range(1024)) + packer.flush()


def _corpus(sa1b_sample) -> dict[str, tuple[str, list[tuple[str, bytes]], bytes, str]]:
    """name -> (key the error names, samples, tail, text the error contains)."""
    key, raw, jpg, ann = sa1b_sample
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    payload = pickle.dumps(_Payload())
    many = b"".join(_member(f"k.x{i}", b"1") for i in range(17))
    end = b"\0" * 1024
    return {
        "path traversal member": (key, [(key, _member("../evil.jpg", jpg))], end, "is not named"),
        "path traversal key": ("../evil", [("../evil", _member("../evil.jpg", jpg))], end, "unsafe sample key"),
        "absolute member": (key, [(key, _member("/etc/passwd", b"root"))], end, "is not named"),
        "backslash member": (key, [(key, _member(f"..\\{key}.jpg", jpg))], end, "is not named"),
        "NUL in member name": (key, [(key, _member(f"{key}\0x.jpg", jpg))], end, "is not named"),
        "long member name": (key, [(key, _member(f"{key}." + "j" * 300, jpg))], end, "not a regular file"),
        "symlink": (key, [(key, _member(f"{key}.jpg", b"", tarfile.SYMTYPE, "/etc/passwd"))], end, "not a regular file"),
        "hardlink": (key, [(key, _member(f"{key}.jpg", b"", tarfile.LNKTYPE, "/etc/passwd"))], end, "not a regular file"),
        "device": (key, [(key, _member(f"{key}.jpg", b"", tarfile.CHRTYPE))], end, "not a regular file"),
        "60 GB member claimed": (key, [(key, _raw_header(f"{key}.jpg", b"%012o" % (60 << 30)))], end, "claims"),
        "100 GB base-256 size": (key, [(key, _raw_header(f"{key}.jpg", b"\x80" + (100 << 30).to_bytes(11, "big")))], end, "invalid tar header"),
        "truncated shard": (key, [(key, raw)], None, "the manifest says"),
        "gzip bomb": (key, [(key, _gzip_bomb())], end, "gzip"),
        "pixel bomb JPEG": (key, [(key, _member(f"{key}.jpg", _bomb_jpeg(jpg, 60000, 60000)) + _member(f"{key}.msgpack", ann))], end, "pixels"),
        "10k x 10k JPEG": (key, [(key, _member(f"{key}.jpg", _bomb_jpeg(jpg, 10000, 10000)) + _member(f"{key}.msgpack", ann))], end, "exceed the cap"),
        "PNG pretending to be JPEG": (key, [(key, _member(f"{key}.jpg", png.getvalue()) + _member(f"{key}.msgpack", ann))], end, "cannot decode JPEG"),
        "msgpack huge str length": (key, [(key, _member(f"{key}.jpg", jpg) + _member(f"{key}.msgpack", b"\xdb\xff\xff\xff\xf0abc"))], end, "cannot unpack"),
        "msgpack huge map": (key, [(key, _member(f"{key}.jpg", jpg) + _member(f"{key}.msgpack", b"\xdf\xff\xff\xff\xff"))], end, "cannot unpack"),
        "msgpack deep nesting": (key, [(key, _member(f"{key}.jpg", jpg) + _member(f"{key}.msgpack", b"\x91" * 100000 + b"\xc0"))], end, "cannot unpack"),
        "msgpack ext type": (key, [(key, _member(f"{key}.jpg", jpg) + _member(f"{key}.msgpack", msgpack.packb(msgpack.ExtType(1, b"x"))))], end, "cannot unpack"),
        "pickle payload": (key, [(key, _member(f"{key}.jpg", payload) + _member(f"{key}.msgpack", payload))], end, "cannot unpack"),
        "pickle member": (key, [(key, _member(f"{key}.jpg", jpg) + _member(f"{key}.msgpack", ann) + _member(f"{key}.pkl", payload))], end, "expected"),
        "unknown field": (key, [(key, _member(f"{key}.jpg", jpg) + _member(f"{key}.msgpack", msgpack.packb({**msgpack.unpackb(ann), "extra": 1})))], end, "fields"),
        "missing field": (key, [(key, _member(f"{key}.jpg", jpg) + _member(f"{key}.msgpack", msgpack.packb({k: v for k, v in msgpack.unpackb(ann).items() if k != "bbox"})))], end, "fields"),
        "missing member": (key, [(key, _member(f"{key}.jpg", jpg))], end, "expected"),
        "too many members": ("k", [("k", many)], end, "more than 16 members"),
        "manifest key disagrees": ("sa_999", [("sa_999", raw)], end, "is not named"),
    }


@pytest.mark.filterwarnings("error")  # refused, not warned
def test_every_hostile_shard_is_refused_with_a_named_error(sa1b_sample, tmp_path):
    PWNED.unlink(missing_ok=True)
    for name, (key, samples, tail, text) in _corpus(sa1b_sample).items():
        root = _dataset(tmp_path / name.replace(" ", "-"), samples, tail)
        before = sorted(os.listdir(root))
        loader = make_stream_loader(root, "train", batch_size=1, num_workers=0, shuffle=False, **SMALL)
        with pytest.raises(ShardstreamError) as caught:
            list(loader)
        message = str(caught.value)
        assert "train-000000.tar: " in message and repr(key) in message, f"{name}: {message}"
        assert text in message.split("train-000000.tar: ", 1)[1], f"{name}: {message}"  # not in the folder name
        assert sorted(os.listdir(root)) == before, f"{name}: nothing is extracted or written"
    assert not PWNED.exists(), "no payload ran"


def test_skipping_goes_past_hostile_samples_within_the_budget(sa1b_sample, tmp_path):
    key, raw, jpg, ann = sa1b_sample
    corpus = _corpus(sa1b_sample)
    hostile = [(f"bad_{i}", s[0][1].replace(s[0][0].encode(), f"bad_{i}".encode()))
               for i, s in enumerate(v[1] for v in corpus.values() if v[0] == key and v[2] is not None) if s]
    samples = [(key, raw)] + hostile[:6]
    root = _dataset(tmp_path / "mixed", samples)
    loader = make_stream_loader(root, "train", batch_size=7, num_workers=2, shuffle=False, on_error="skip", **SMALL)
    assert [b["keys"] for b in loader] == [[key]]
    assert loader.skipped == 6
    strict = make_stream_loader(root, "train", batch_size=7, num_workers=0, shuffle=False, on_error="skip",
                                max_errors=3, **SMALL)
    with pytest.raises(ShardstreamError, match="4 samples skipped in this epoch, more than max_errors=3"):
        list(strict)
    fraction = make_stream_loader(root, "train", batch_size=7, num_workers=0, on_error="skip", max_errors=0.5, **SMALL)
    with pytest.raises(ShardstreamError, match="max_errors=0.5"):
        list(fraction)


def _longest_quoted(text: str, secret: str) -> int:
    """The longest run of characters of `secret` that `text` quotes."""
    best = 0
    for i in range(len(secret)):
        while i + best < len(secret) and secret[i : i + best + 1] in text:
            best += 1
    return best


def test_the_skip_log_and_errors_quote_no_bytes_of_what_they_read(sa1b_sample, tmp_path, caplog):
    """A manifest's sample ranges over a file that holds no samples (any file: here, 4 KiB of secret
    text; before, 8 bytes of each sample's size field, and member names whole, went to the log)."""
    key, raw, jpg, ann = sa1b_sample
    secret = "".join(random.Random(8).choice(string.ascii_uppercase + string.digits) for _ in range(4096))
    named = _member(f"{key}.jpg", jpg).replace(f"{key}.jpg".encode(), secret[:100].encode().ljust(len(key) + 4, b"\0"), 1)
    header = bytearray(named[:BLOCK])
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    samples = [(f"k{i}", secret[i * 512 : (i + 1) * 512].encode()) for i in range(8)] + \
        [("k8", bytes(header) + named[BLOCK:]), (key, raw)]
    root = _dataset(tmp_path / "secret", samples)
    caplog.set_level(logging.WARNING)
    loader = make_stream_loader(root, "train", batch_size=10, num_workers=0, shuffle=False, on_error="skip", **SMALL)
    assert [b["keys"] for b in loader] == [[key]] and loader.skipped == 9
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert log.count("skipped: ") == 9 and _longest_quoted(log, secret) <= 3, log
    loader = make_stream_loader(root, "train", batch_size=10, num_workers=0, shuffle=False, **SMALL)
    with pytest.raises(ShardstreamError) as caught:
        list(loader)
    assert "byte 0" in str(caught.value) and _longest_quoted(str(caught.value), secret) <= 3


def test_hostile_manifests_are_refused(tmp_path):
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ManifestError, match="not valid JSON"):
        make_stream_loader(str(deep), "train", batch_size=1, num_workers=0)
    huge_int = tmp_path / "int"
    huge_int.mkdir()
    (huge_int / "manifest.json").write_text('{"format": "shardstream", "schema_version": ' + "9" * 100000 + "}")
    with pytest.raises(ManifestError):
        make_stream_loader(str(huge_int), "train", batch_size=1, num_workers=0)


_VERIFY_ALL = """
import json, resource, sys
from shard_tools.verify import verify
clean, *hostile = sys.argv[1:]
assert verify(clean, progress=False) == []
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
found = [len(verify(root, progress=False)) for root in hostile]
print(json.dumps([baseline, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, found]))
"""


def test_hostile_corpus_does_not_blow_up_memory(sa1b_sample, sa1b_dataset, tmp_path):
    """`verify` (the reader and decoder) over every hostile dataset in a fresh process: its peak RSS
    stays within 200 MB of what a clean dataset needs, and every dataset has problems reported."""
    roots = [_dataset(tmp_path / name.replace(" ", "-"), samples, tail)
             for name, (_, samples, tail, _) in _corpus(sa1b_sample).items()]
    out = subprocess.run([sys.executable, "-c", _VERIFY_ALL, sa1b_dataset, *roots], capture_output=True, text=True,
                         check=True)
    baseline, peak, found = json.loads(out.stdout.splitlines()[-1])
    assert all(found), dict(zip(_corpus(sa1b_sample), found))
    assert peak < baseline + 200 * 1024, f"peak RSS {peak // 1024} MB vs {baseline // 1024} MB for a clean dataset"
    assert not PWNED.exists()
