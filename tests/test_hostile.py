"""Shards are untrusted: hostile and broken shards are refused with a named error, without side
effects and without memory blow-up. The corpus is generated here."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import logging
import os
import pathlib
import pickle
import random
import re
import shutil
import string
import subprocess
import sys
import tarfile
import threading
import zlib

import msgpack
import pytest
from PIL import Image
from procs import run_bounded

from pipeline import ManifestError, ShardstreamError, make_stream_loader
from pipeline.errors import ShardError
from pipeline.tario import BLOCK
from shard_tools.index import index_sa1b

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


# -- A dataset folder is untrusted input: names resolve inside it, only regular files are read -----------

def _indexed_outside(sa1b_src: pathlib.Path, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(dataset folder, the archives' folder outside it): SA-1B archives indexed in place elsewhere."""
    archives, out = tmp_path / "archives", tmp_path / "dataset"
    shutil.copytree(sa1b_src, archives)
    index_sa1b([str(archives)], str(out), progress=False)
    return out, archives


def _rename_shards(out: pathlib.Path, names: dict[str, str]) -> None:
    """Edit the manifest's shard names (what a hostile manifest may say)."""
    manifest = json.loads((out / "manifest.json").read_text())
    for split in manifest["splits"].values():
        split["shards"]["name"] = [names.get(name, name) for name in split["shards"]["name"]]
    (out / "manifest.json").write_text(json.dumps(manifest))


def _keys(root: str, **settings) -> list[str]:
    loader = make_stream_loader(root, "train", batch_size=1, num_workers=0, drop_last=False, **{**SMALL, **settings})
    return sorted(k for batch in loader for k in batch["keys"])


def test_a_file_outside_the_folder_is_read_only_where_the_user_allows_it(sa1b_src, tmp_path):
    """An archive indexed in place outside the dataset's folder (`shard-pack index` into another OUT)
    is read only under `allowed_roots`; before, a manifest naming any absolute path was read."""
    out, archives = _indexed_outside(sa1b_src, tmp_path)
    with pytest.raises(ShardError, match=rf"{archives}/sa_000000\.tar: the manifest of {out} names a file outside its "
                                         rf"folder; it is read only where you allow it: allowed_roots=\[\.\.\.\] "
                                         rf"\(shard-pack: --allow-root\), e\.g\. allowed_roots=\['{archives}'\]"):
        make_stream_loader(str(out), "train", batch_size=1, num_workers=0, **SMALL)
    assert len(_keys(str(out), allowed_roots=[str(archives)])) == 14
    assert len(_keys(str(out), allowed_roots=[str(tmp_path)])) == 14  # (a folder above it)
    victim = tmp_path / "victim"  # a place the user never named, beside the one they did
    shutil.copytree(archives, victim)
    _rename_shards(out, {f"{archives}/sa_000000.tar": f"{victim}/sa_000000.tar"})
    with pytest.raises(ShardError, match=f"{victim}/sa_000000.tar: the manifest of .* names a file outside its folder"):
        _keys(str(out), allowed_roots=[str(archives)])
    (tmp_path / "archives2").mkdir()  # (a root is a whole path component: archives2 is not under archives)
    _rename_shards(out, {f"{victim}/sa_000000.tar": f"{tmp_path}/archives2/sa_000000.tar"})
    with pytest.raises(ShardError, match="names a file outside its folder"):
        _keys(str(out), allowed_roots=[str(archives)])
    with pytest.raises(ValueError, match="allowed_roots must be a list of paths or URLs"):
        _keys(str(out), allowed_roots=str(archives))


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        self.seen.append(f"GET {self.path}")
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802
        self.seen.append(f"HEAD {self.path}")
        self.send_response(200)
        self.send_header("Content-Length", "1000000")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("place", ["http", "s3"])
def test_a_url_in_a_local_dataset_is_never_asked_for(sa1b_src, tmp_path, place):
    """Before: the loader sent a HEAD and ranged GETs to the host a manifest named (or read another
    bucket with the user's own credentials); now nothing is sent, and the error names the option."""
    out, archives = _indexed_outside(sa1b_src, tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/x.tar" if place == "http" else "s3://victim/x.tar"
        _rename_shards(out, {f"{archives}/sa_000000.tar": url})
        with pytest.raises(ShardError, match=f"{url}: the manifest of .* names a file outside its folder; .*allowed_roots"):
            _keys(str(out), allowed_roots=[str(archives)], storage_options={"anon": True})
        assert _Recorder.seen == []
    finally:
        server.shutdown()
        server.server_close()


def test_a_symlink_out_of_the_folder_is_followed_only_where_allowed(sa1b_dataset, tmp_path):
    """A shard or index that is a symlink is read only if it leads inside the folder (or an allowed
    root): before, a link to any file was read."""
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    shutil.copytree(sa1b_dataset, data)
    elsewhere.mkdir()
    shard = data / "train-000000.tar"
    shutil.move(shard, elsewhere / shard.name)
    shard.symlink_to(elsewhere / shard.name)
    expected = _keys(sa1b_dataset)
    with pytest.raises(ShardError, match=rf"train-000000\.tar: sample 'sa_\d+': {shard} is a symlink to {elsewhere}/train-000000\.tar, "
                                         r"outside the dataset's folder .*allowed_roots"):
        _keys(str(data))
    assert _keys(str(data), allowed_roots=[str(elsewhere)]) == expected
    index = data / "train-000000.idx"
    shutil.move(index, elsewhere / index.name)
    index.symlink_to(elsewhere / index.name)
    with pytest.raises(ShardError, match=rf"train-000000\.idx: {index} is a symlink to .*, outside the dataset's folder"):
        _keys(str(data), allowed_roots=[str(tmp_path / "other")])
    assert _keys(str(data), allowed_roots=[str(elsewhere)]) == expected
    (data / "inside").mkdir()  # a link that stays inside the folder is followed
    shutil.move(elsewhere / shard.name, data / "inside" / shard.name)
    shard.unlink()
    shard.symlink_to(pathlib.Path("inside", shard.name))
    assert _keys(str(data), allowed_roots=[str(elsewhere)]) == expected


def test_a_hub_snapshot_is_read_through_its_links_into_its_blobs(sa1b_dataset, tmp_path):
    """huggingface_hub stores each file once in the repository's blobs/ and links it from each
    snapshot: those links are followed (and links anywhere else are not)."""
    repo = tmp_path / "hub" / "datasets--someone--sa1b-tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in pathlib.Path(sa1b_dataset).iterdir():
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(pathlib.Path("..", "..", "blobs", blob.name))
    assert _keys(str(snapshot)) == _keys(sa1b_dataset)
    (tmp_path / "secret.tar").write_bytes((repo / "blobs" / os.readlink(snapshot / "train-000000.tar").split("/")[-1]).read_bytes())
    (snapshot / "train-000000.tar").unlink()
    (snapshot / "train-000000.tar").symlink_to(tmp_path / "secret.tar")
    with pytest.raises(ShardError, match="is a symlink to .*secret.tar, outside the dataset's folder"):
        _keys(str(snapshot))


_HANGS = """
import sys
from pipeline import make_stream_loader
root, verify, allowed = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    loader = make_stream_loader(root, "train", batch_size=1, num_workers=0, verify=verify, image_size=32, mask_size=8,
                                max_masks=2, **({"allowed_roots": allowed} if allowed else {}))
    for batch in loader:
        pass
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def _run(args: list[str], seconds: float = 60) -> str:
    """A fresh process's output (stdout and stderr); an AssertionError if it runs past `seconds`."""
    return run_bounded(args, seconds, f"still running after {seconds} s (hung): {args}", stderr=subprocess.STDOUT)[0]


def test_a_fifo_or_a_device_is_refused_not_read_forever(sa1b_dataset, tmp_path):
    """Before: a FIFO as an index file hung the loader forever, and a shard linked to /dev/zero hashed
    forever with verify='sha256'; `shard-pack verify` hung on both."""
    fifo, zero = tmp_path / "fifo", tmp_path / "zero"
    shutil.copytree(sa1b_dataset, fifo)
    (fifo / "train-000000.idx").unlink()
    os.mkfifo(fifo / "train-000000.idx")
    shutil.copytree(sa1b_dataset, zero)
    (zero / "train-000000.tar").unlink()
    (zero / "train-000000.tar").symlink_to("/dev/zero")
    out = _run([sys.executable, "-c", _HANGS, str(fifo), "size"])
    assert f"ShardIndexError {fifo}/train-000000.idx: {fifo}/train-000000.idx is a FIFO, not a regular file" in out, out
    out = _run([sys.executable, "-c", _HANGS, str(zero), "sha256"])
    assert "is a symlink to /dev/zero, outside the dataset's folder" in out, out
    out = _run([sys.executable, "-c", _HANGS, str(zero), "sha256", "/dev"])
    assert re.search(r"train-000000\.tar: sample '\w+': /dev/zero is a character device, not a regular file", out), out
    for root, allowed in ((fifo, []), (zero, ["--allow-root", "/dev"])):
        out = _run([sys.executable, "-m", "shard_tools.cli", "-q", "verify", str(root), *allowed])
        assert "not a regular file" in out and "verify: " in out, out
