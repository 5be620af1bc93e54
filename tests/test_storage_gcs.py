"""gs:// (Google Cloud Storage) against a real emulator the tests start on 127.0.0.1 (fake-gcs-server,
`shard_tools.samples.localgcs`): streaming by range and through the shard cache equals local disk
sample for sample, packing is byte-identical, the CLI reads and writes with --storage-options or the
environment alone, and every fault mode of the proxy (tests/objectstore.py, with GCS's JSON error
answers) is retried without loss, or fails naming the URL and the cause, on both clients: the lean
one (obstore) and gcsfs's."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys
import urllib.parse
import uuid

import pytest
from objectstore import FaultProxy

from pipeline import make_stream_loader
from pipeline.errors import ManifestError, ShardError
from pipeline.format import Manifest
from pipeline.storage import Retry, filesystem
from pipeline.storage.ranged import ranged_reader
from pipeline.storage.retry import throttled, transient
from shard_tools.cli import main
from shard_tools.pack import PackError, PackOptions, pack
from shard_tools.sa1b import Sa1bSource
from shard_tools.samples.localgcs import GCS_ENV, FakeGCS, storage_options
from shard_tools.verify import verify
from conftest import indexed, split_keys
from test_storage import FAST, SMALL, _epoch, _same

os.environ.update(GCS_ENV)  # (before google-auth is imported: it reads NO_GCE_CHECK once)
REPO = str(pathlib.Path(__file__).resolve().parent.parent)


def _answer(status: str, code: int, message: str, reason: str) -> tuple[bytes, bytes]:
    """An error answer of GCS's JSON API (its XML API's differ in the body only)."""
    body = json.dumps({"error": {"code": code, "message": message, "errors": [
        {"message": message, "domain": "global", "reason": reason}]}}).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json; charset=UTF-8\r\nContent-Length: %d\r\n"
            "Connection: close\r\n\r\n").encode(), body


GCS_ANSWERS = {"slowdown": _answer("503 Service Unavailable", 503, "We encountered an internal error. Please try "
                                   "again.", "backendError"),
               "error500": _answer("500 Internal Server Error", 500, "Internal Error", "internalError"),
               "refused": _answer("401 Unauthorized", 401, "Invalid Credentials", "authError")}
# Options for each ranged client: the lean one (obstore), and gcsfs (an option the lean one cannot honour).
# gcsfs's requests bounded at 20 s here: an answer the emulator behind the fault proxy never gives
# (seen once in a hundred runs) is then a retry, not 300 s of waiting.
CLIENT_OPTIONS = {"lean": {}, "gcsfs": {"session_kwargs": {"trust_env": False}, "requests_timeout": 20}}


@pytest.fixture(autouse=True)
def _no_google_environment(monkeypatch):
    """No credentials or emulator of the user's: a test sets what it uses (nothing here reaches Google)."""
    for name in [n for n in os.environ if n.startswith(("GOOGLE_", "GCSFS_")) or n == "STORAGE_EMULATOR_HOST"]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory):
    """fake-gcs-server on 127.0.0.1 for the module's tests."""
    server = FakeGCS(tmp_path_factory.mktemp("fake-gcs"))
    server.start()
    yield server
    server.stop()


def _bucket(gcs: FakeGCS) -> str:
    name = f"t{uuid.uuid4().hex[:12]}"
    filesystem(f"gs://{name}", storage_options(gcs.endpoint))[0].mkdir(name)
    return name


def _upload(gcs: FakeGCS, folder: str | pathlib.Path) -> str:
    """A copy of a local folder in a new bucket: its gs:// URL."""
    url = f"gs://{_bucket(gcs)}/data"
    fs, path = filesystem(url, storage_options(gcs.endpoint))
    fs.put(f"{folder}/", f"{path}/", recursive=True)
    return url


@pytest.fixture(scope="module")
def remote(gcs: FakeGCS, sa1b_dataset: str) -> str:
    return _upload(gcs, sa1b_dataset)


@pytest.fixture
def proxy(gcs: FakeGCS):
    p = FaultProxy(gcs.port, answers=GCS_ANSWERS)
    yield p
    p.close()


def _name(request) -> str:
    """The object a request is about (the XML API's `/bucket/key`, the JSON API's `.../o/key`)."""
    return urllib.parse.unquote(request.target.split("?")[0]).rsplit("/", 1)[1]


def _is_shard_read(request) -> bool:
    """A GET of a shard's bytes (not of its metadata: gcsfs's size or info)."""
    return request.method == "GET" and _name(request).endswith(".tar") and not request.target.startswith("/storage/")


def _clients(proxy: FaultProxy) -> set[str]:
    return {r.headers.get("user-agent", "").split("/")[0] for r in proxy.requests if _is_shard_read(r)}


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_from_gs_by_range_equals_local_disk(remote, sa1b_dataset, proxy, workers):
    local = _epoch(sa1b_dataset, num_workers=workers)
    _same(_epoch(remote, storage_options=storage_options(proxy.endpoint), num_workers=workers), local)
    shard_reads = [r for r in proxy.requests if _is_shard_read(r)]
    assert shard_reads and all("range" in r.headers for r in shard_reads)
    if workers == 0:  # (workers forked after the main process ran obstore read through gcsfs)
        assert _clients(proxy) == {"object_store"}


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_from_gs_through_the_cache_equals_local_disk(remote, sa1b_dataset, proxy, tmp_path, workers):
    options = dict(storage_options=storage_options(proxy.endpoint), cache_dir=str(tmp_path / "cache"),
                   cache_limit=1 << 30, num_workers=workers)
    local = _epoch(sa1b_dataset, num_workers=workers)
    _same(_epoch(remote, **options), local)  # cold
    manifest = Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(), "m")
    sizes = {s.name: s.bytes for s in manifest.splits["train"]}
    whole = [_name(r) for r in proxy.requests if _is_shard_read(r) and r.headers.get("range") ==
             f"bytes=0-{sizes.get(_name(r), 0) - 1}"]
    assert sorted(whole) == sorted(sizes), "each shard downloaded once, whole"
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.tar")) == \
        sorted(f"{s.sha256}.tar" for s in manifest.splits["train"])
    proxy.clear()
    _same(_epoch(remote, **options), local)  # warm: nothing read but the manifest's metadata
    assert not [r for r in proxy.requests if _is_shard_read(r) or _name(r).endswith(".idx")], proxy.requests


def test_workers_of_every_start_method_read_gs(remote, sa1b_dataset, gcs):
    local = _epoch(sa1b_dataset, num_workers=2)
    for context in ("spawn", "forkserver"):
        _same(_epoch(remote, num_workers=2, multiprocessing_context=context,
                     storage_options=storage_options(gcs.endpoint)), local)


def test_pack_to_gs_with_the_environment_alone_is_byte_identical_to_local(sa1b_src, tmp_path, gcs, monkeypatch):
    """STORAGE_EMULATOR_HOST, as gcsfs and Google's clients read it: no options at all (anonymous)."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    options = PackOptions(shard_samples=3, splits=(("train", 0.7), ("val", 0.3)), workers=2)
    out = f"gs://{_bucket(gcs)}/packed"
    pack(Sa1bSource(), [str(sa1b_src)], out, options, progress=False)
    pack(Sa1bSource(), [str(sa1b_src)], str(tmp_path / "local"), options, progress=False)
    fs, base = filesystem(out)
    remote_files = {p.removeprefix(base + "/"): fs.cat_file(p) for p in fs.find(base)}
    local_files = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert remote_files == local_files  # no `_pack` state left, manifest and shards equal
    _same(_epoch(out), _epoch(str(tmp_path / "local")))
    _same(_epoch(out, cache_dir=str(tmp_path / "cache"), cache_limit=1 << 30), _epoch(str(tmp_path / "local")))


def test_pack_to_a_missing_bucket_is_a_clear_error(sa1b_src, gcs, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    with pytest.raises(PackError, match="does the bucket exist"):
        pack(Sa1bSource(), [str(sa1b_src)], f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/x", PackOptions(),
             progress=False)


@pytest.mark.parametrize("client", ["lean", "gcsfs"])
@pytest.mark.parametrize("mode", ["slowdown", "error500", "reset", "cut"])
def test_transient_faults_are_retried_without_loss(remote, sa1b_dataset, proxy, mode, client):
    proxy.fault(mode, count=3, after_bytes=1000, match=_is_shard_read)
    result = _epoch(remote, storage_options=storage_options(proxy.endpoint, **CLIENT_OPTIONS[client]), retry=FAST)
    _same(result, _epoch(sa1b_dataset))
    assert proxy.served(mode) == 3
    assert _clients(proxy) == ({"object_store"} if client == "lean" else {"python-gcsfs"})


@pytest.mark.parametrize("client", ["lean", "gcsfs"])
def test_stall_past_the_request_timeout_is_retried(remote, sa1b_dataset, proxy, client):
    proxy.fault("stall", count=1, seconds=4, match=_is_shard_read)
    options = storage_options(proxy.endpoint, **{**CLIENT_OPTIONS[client], "requests_timeout": 1})
    _same(_epoch(remote, storage_options=options, retry=FAST), _epoch(sa1b_dataset))
    assert proxy.served("stall") == 1


@pytest.mark.parametrize("client", ["lean", "gcsfs"])
@pytest.mark.parametrize("mode", ["slowdown", "error500", "reset"])
def test_faults_past_the_bound_fail_naming_url_and_cause(remote, proxy, mode, client):
    proxy.fault(mode, count=1000, match=_is_shard_read)
    with pytest.raises(ShardError, match=rf"{remote}/train-\d+\.tar: sample .*after 4 tries") as info:
        _epoch(remote, storage_options=storage_options(proxy.endpoint, **CLIENT_OPTIONS[client]), retry=FAST,
               read_ahead=0, batch_size=1)
    said = {"slowdown": "503", "error500": "500", "reset": "Error"}[mode]
    assert said in str(info.value), str(info.value)
    # exactly `attempts` tries (the clients' own retries are off); aiohttp (gcsfs) repeats an idempotent
    # request once when the connection drops before the answer (RFC 9112 section 9.3.1)
    assert proxy.served(mode) == (8 if (client, mode) == ("gcsfs", "reset") else 4)


@pytest.mark.parametrize("client", ["lean", "gcsfs"])
def test_an_epoch_under_30_percent_throttling_finishes(remote, sa1b_dataset, proxy, client):
    """503 on 30% of GETs, one try allowed for any other failure: throttling is ridden out within the
    time budget, and the epoch is what local disk gives."""
    gets = itertools.count()
    proxy.fault("slowdown", count=1 << 30, match=lambda r: r.method == "GET" and next(gets) % 10 < 3)
    retry = Retry(attempts=1, initial_delay=0.01, max_delay=0.05, throttle_seconds=30)
    result = _epoch(remote, storage_options=storage_options(proxy.endpoint, **CLIENT_OPTIONS[client]), retry=retry,
                    num_workers=2, read_ahead_bytes=0)  # (a request per sample)
    _same(result, _epoch(sa1b_dataset))
    assert proxy.served("slowdown") >= 0.25 * len(proxy.gets()) >= 5


@pytest.mark.parametrize("client", ["lean", "gcsfs"])
def test_refused_credentials_fail_at_once_naming_the_shard(remote, sa1b_dataset, proxy, client):
    proxy.fault("refused", count=1000, match=_is_shard_read)
    with pytest.raises(ShardError, match=rf"{remote}/train-\d+\.tar: sample '[^']+': cannot read bytes \d+-\d+: "
                                         r"(PermissionError: 401|HttpError: Invalid Credentials, 401)"):
        _epoch(remote, storage_options=storage_options(proxy.endpoint, **CLIENT_OPTIONS[client]), retry=FAST,
               read_ahead=0, batch_size=1)
    assert proxy.served("refused") == 1, "no retries"
    proxy.clear()
    proxy.fault("refused", count=1000)
    with pytest.raises(ManifestError, match=rf"{remote}/manifest.json"):
        make_stream_loader(remote, "train", batch_size=2, storage_options=storage_options(proxy.endpoint),
                           retry=FAST, **SMALL)
    targets = [r.target for r in proxy.requests]  # (gcsfs looks for the object, then for a folder of its name)
    assert len(set(targets)) == len(targets) == proxy.served("refused"), "no retries"


def _changed(gcs: FakeGCS, sa1b_dataset: str, change: str) -> tuple[str, str, list[str], int]:
    """A copy of the dataset with one shard rewritten upstream: "same-size" (a byte of a JPEG's header: it
    still decodes), "longer" or "shorter". (The dataset's URL, that shard's URL, its keys, its new size.)"""
    source = _upload(gcs, sa1b_dataset)
    shard, index = indexed(sa1b_dataset)[1]
    data = bytearray(pathlib.Path(sa1b_dataset, shard.name).read_bytes())
    if change == "same-size":
        data[index.span(0)[0] + 512 + 15] ^= 0x01  # (the JPEG's pixel density)
    elif change == "longer":
        data += bytes(1024)
    else:
        data = data[: index.span(len(index.key_list()) - 1)[0] + 600]
    fs, path = filesystem(f"{source}/{shard.name}", storage_options(gcs.endpoint))
    fs.pipe_file(path, bytes(data))
    return source, f"{source}/{shard.name}", index.key_list(), len(data)


def test_a_shard_changed_upstream_at_the_same_size_is_an_error_with_the_cache(gcs, sa1b_dataset, tmp_path):
    source, url, keys, _ = _changed(gcs, sa1b_dataset, "same-size")
    options = dict(storage_options=storage_options(gcs.endpoint), cache_dir=str(tmp_path / "cache"),
                   cache_limit=1 << 30)
    with pytest.raises(ShardError, match=rf"{url}: .*downloaded shard has SHA-256 [0-9a-f]{{64}}, the manifest says"):
        _epoch(source, **options)
    loader = make_stream_loader(source, "train", batch_size=2, num_workers=0, seed=5, on_error="skip", drop_last=False,
                                **options, **SMALL)
    seen = [k for batch in loader for k in batch["keys"]]
    assert not set(seen) & set(keys) and loader.skipped == len(keys)
    assert sorted(seen) == sorted(set(split_keys(sa1b_dataset)) - set(keys))


@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_a_shard_resized_upstream_is_named_by_its_sizes_without_asking_them(gcs, sa1b_dataset, proxy, change):
    source, url, keys, size = _changed(gcs, sa1b_dataset, change)
    expected = indexed(sa1b_dataset)[1][0].bytes
    with pytest.raises(ShardError, match=rf"{url}: sample '[^']+': shard is {size} bytes, the manifest says {expected}"):
        _epoch(source, storage_options=storage_options(proxy.endpoint), shuffle=False)
    proxy.clear()
    loader = make_stream_loader(source, "train", batch_size=2, num_workers=0, seed=5, on_error="skip",
                                drop_last=False, storage_options=storage_options(proxy.endpoint), **SMALL)
    seen = [k for batch in loader for k in batch["keys"]]
    assert sorted(seen) == sorted(set(split_keys(sa1b_dataset)) - set(keys)) and loader.skipped == len(keys)
    sizes = [r for r in proxy.requests if _name(r).endswith(".tar") and not _is_shard_read(r)]
    assert not sizes, "no request asks for a shard's size: every answer says it"


def test_a_cut_stream_resumes_from_the_byte_reached(remote, sa1b_dataset, proxy, monkeypatch):
    from pipeline import storage

    monkeypatch.setattr(storage.s3, "STREAM_CHUNK", 256)
    shard = indexed(sa1b_dataset)[0][0]
    reader = ranged_reader(f"{remote}/{shard.name}", storage_options(proxy.endpoint), FAST)
    assert type(reader.client).__name__ == "GCSClient"
    proxy.fault("cut", count=1, after_bytes=1000, match=_is_shard_read)
    data = b"".join(bytes(chunk) for chunk in reader.stream(0, shard.bytes))
    assert data == pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    first, second = (r.headers["range"] for r in proxy.gets())
    resumed = int(second.removeprefix("bytes=").split("-")[0])
    assert first == f"bytes=0-{shard.bytes - 1}" and 0 < resumed <= 1000, (first, second)


def test_verify_on_gs_reads_each_shard_once(remote, sa1b_dataset, proxy):
    assert verify(remote, progress=False, storage_options=storage_options(proxy.endpoint)) == []
    manifest = Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(), "m")
    names = [_name(r) for r in proxy.requests if _is_shard_read(r)]
    shards = [s.name for split in manifest.splits.values() for s in split]
    assert sorted(names) == sorted(shards)


@pytest.mark.parametrize(("error", "expected"), [
    (lambda: _gcsfs_error(503, "We encountered an internal error. Please try again."), True),
    (lambda: _gcsfs_error(429, "The rate of change requests to the object exceeds the rate limit."), True),
    (lambda: _gcsfs_error(500, "Internal Error"), True),
    (lambda: _gcsfs_error(401, "Invalid Credentials"), False),
    (lambda: _gcsfs_error(416, "Requested range not satisfiable"), False),
    (lambda: PermissionError("Forbidden: b/o"), False),
], ids=["503", "429", "500", "401", "416", "403"])
def test_gcsfs_failures_are_classified_for_retry(error, expected):
    assert transient(error()) is expected
    assert throttled(error()) is (str(error()).endswith(("503", "429")))


def _gcsfs_error(code: int, message: str) -> Exception:
    from gcsfs.retry import HttpError

    return HttpError({"code": code, "message": message})


def test_forbidden_from_gcsfs_is_a_permission_error(remote, proxy):
    forbidden = _answer("403 Forbidden", 403, "anonymous caller does not have storage.objects.get access",
                        "forbidden")
    refusing = FaultProxy(proxy.upstream_port, answers={**GCS_ANSWERS, "refused": forbidden})
    try:
        refusing.fault("refused", count=1000)
        fs, path = filesystem(f"{remote}/manifest.json", storage_options(refusing.endpoint))
        with pytest.raises(PermissionError, match="Forbidden"):
            fs.cat_file(path)
        assert refusing.served("refused") == 1
    finally:
        refusing.close()


# `shard-pack` where gcsfs cannot be imported: a ConfigError (exit 2) naming the extra, not a traceback.
_NO_GCSFS = """
import sys
sys.modules["gcsfs"] = sys.modules["gcsfs.core"] = None
from shard_tools.cli import main
sys.exit(main(["inspect", "gs://bucket/data"]))
"""


def test_a_missing_gcsfs_is_a_clear_error():
    run = subprocess.run([sys.executable, "-c", _NO_GCSFS], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "gs://bucket/data" in run.stderr and "install the package's gcs extra, or pip install 'gcsfs>=2024.2'" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr


def _cli_options(gcs: FakeGCS) -> list[str]:
    return ["--storage-options", json.dumps(storage_options(gcs.endpoint))]


@pytest.mark.parametrize("given", ["options", "environment"])
def test_the_cli_reads_gs_with_the_options_or_the_environment(remote, gcs, sa1b_dataset, sa1b_src, tmp_path, capsys,
                                                               monkeypatch, given):
    """inspect, verify, preview, tune and index, with --storage-options alone, or STORAGE_EMULATOR_HOST alone."""
    if given == "environment":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    flags = _cli_options(gcs) if given == "options" else []
    assert main(["inspect", remote, *flags]) == 0
    assert "split train:" in capsys.readouterr().out
    assert main(["-q", "verify", remote, *flags]) == 0
    assert capsys.readouterr().out.strip().endswith("verify: OK")
    small = ["--image-size", "32", "--mask-size", "8", "--max-masks", "2"]
    assert main(["preview", remote, "--split", "train", "-n", "4", "--out", str(tmp_path / "gs.png"), *small,
                 *flags]) == 0
    assert main(["preview", sa1b_dataset, "--split", "train", "-n", "4", "--out", str(tmp_path / "local.png"),
                 *small]) == 0
    assert (tmp_path / "gs.png").read_bytes() == (tmp_path / "local.png").read_bytes()
    assert main(["-q", "tune", remote, "--split", "train", "--batch-size", "2", "--workers", "0", "--batches", "2",
                 "--warmup", "1", *small, *flags]) == 0
    assert "recommended: num_workers=0" in capsys.readouterr().out
    archives = _upload(gcs, sa1b_src)
    assert main(["-q", "index", "sa1b", archives, f"{archives}-index", "--workers", "2", *flags]) == 0
    assert main(["-q", "verify", f"{archives}-index", "--allow-root", archives, *flags]) == 0
    capsys.readouterr()


def test_the_cli_packs_to_gs_with_the_options_given(gcs, sa1b_src, tmp_path):
    out = f"gs://{_bucket(gcs)}/sa1b"
    assert main(["-q", "sa1b", str(sa1b_src), str(tmp_path / "local")]) == 0
    assert main(["-q", "sa1b", str(sa1b_src), out, "--workers", "2", *_cli_options(gcs)]) == 0
    fs, base = filesystem(out, storage_options(gcs.endpoint))
    written = {p.removeprefix(base + "/"): fs.cat_file(p) for p in fs.find(base)}
    assert written == {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir() if p.is_file()}


class _TokenServer:
    """Google's OAuth token endpoint played on 127.0.0.1: each POST is answered with a new access token
    ("tok1", "tok2", ...) valid for an hour; `refuse` answers 400 invalid_grant instead."""

    def __init__(self) -> None:
        import http.server
        import threading

        issued, server = [], self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if server.refuse:
                    status, body = 400, {"error": "invalid_grant", "error_description": "Invalid JWT Signature."}
                else:
                    issued.append(f"tok{len(issued) + 1}")
                    status, body = 200, {"access_token": issued[-1], "expires_in": 3600, "token_type": "Bearer"}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.issued, self.refuse = issued, False
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def key_file(self, path: pathlib.Path) -> pathlib.Path:
        """A service account's JSON key whose tokens this server issues, written to `path`."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
        path.write_text(json.dumps({
            "type": "service_account", "project_id": "shardstream-test", "private_key_id": "test", "private_key": key,
            "client_email": "loader@shardstream-test.iam.gserviceaccount.com", "client_id": "1",
            "token_uri": f"http://127.0.0.1:{self.httpd.server_address[1]}/token"}))
        return path

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_google_application_credentials_sign_every_request_of_both_clients(remote, sa1b_dataset, proxy, tmp_path,
                                                                          monkeypatch):
    """GOOGLE_APPLICATION_CREDENTIALS (a service account's key) and STORAGE_EMULATOR_HOST, no options: the
    token google-auth gets for the key signs the lean client's requests and gcsfs's alike; a key whose
    tokens are refused is a clear error, not retried."""
    tokens = _TokenServer()
    try:
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tokens.key_file(tmp_path / "key.json")))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        _same(_epoch(remote), _epoch(sa1b_dataset))
        assert tokens.issued, "a token was asked for"
        signed = {r.headers.get("authorization") for r in proxy.requests}
        assert signed <= {f"Bearer {token}" for token in tokens.issued}, signed
        assert _clients(proxy) == {"object_store"} and any(
            r.headers.get("user-agent", "").startswith("python-gcsfs") for r in proxy.requests)
        tokens.refuse = True
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tokens.key_file(tmp_path / "refused.json")))
        with pytest.raises(ManifestError, match=rf"{remote}/manifest.json: .*Invalid Credentials"):
            _epoch(remote, retry=FAST)
        shard = f"{remote}/{indexed(sa1b_dataset)[0][0].name}"
        reader = ranged_reader(shard, None, FAST)
        assert type(reader.client).__name__ == "GCSClient"
        with pytest.raises(ShardError, match=rf"{shard}: cannot read bytes 0-10: PermissionError: .*Invalid Credentials"):
            reader.read(0, 10)  # (no "after 4 tries")
    finally:
        tokens.close()
