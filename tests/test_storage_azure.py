"""Azure Blob Storage (`az://`) against a real emulator the tests start (Azurite on 127.0.0.1, the
development account): packing to and streaming from az:// equal to local disk by range and through the
cache, the CLI with `--storage-options` and with the environment alone, and every fault mode of the
proxy (`objectstore.FaultProxy` answering with Azure's error bodies)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
from objectstore import FaultProxy

from pipeline import make_stream_loader, storage
from pipeline.errors import ConfigError, ManifestError, ShardError, about_sample
from pipeline.format import Manifest
from pipeline.storage import Retry, filesystem
from pipeline.storage.azure import EMULATOR_KEY, AzureError
from pipeline.storage.azure import client as azure_client
from pipeline.storage.ranged import ranged_reader
from pipeline.storage.retry import throttled, transient
from shard_tools.cli import main
from shard_tools.pack import PackError, PackOptions, pack
from shard_tools.sa1b import Sa1bSource
from shard_tools.samples.localazure import Azurite, connection_string, storage_options, unavailable
from shard_tools.verify import verify
from conftest import indexed, split_keys
from test_storage import FAST, SMALL, _epoch, _is_shard_read, _RetryClock, _same

REPO = str(pathlib.Path(__file__).resolve().parent.parent)
SERVER_BUSY = (b"HTTP/1.1 503 The server is busy.\r\nContent-Type: application/xml\r\nx-ms-error-code: ServerBusy\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n")
SERVER_BUSY_BODY = (b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code><Message>Egress is over the '
                    b'account limit.</Message></Error>')
INTERNAL = (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\nx-ms-error-code: InternalError\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n")
INTERNAL_BODY = (b'<?xml version="1.0" encoding="utf-8"?><Error><Code>InternalError</Code><Message>The server '
                 b'encountered an internal error. Please retry the request.</Message></Error>')
AZURE_ANSWERS = {"slowdown": (SERVER_BUSY, SERVER_BUSY_BODY), "error500": (INTERNAL, INTERNAL_BODY)}


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory):
    why = unavailable()  # (where Azurite could not be installed, the tests that need it skip, saying why)
    if why is not None:
        pytest.skip(why)
    emulator = Azurite(tmp_path_factory.mktemp("azurite"))
    emulator.start()
    yield emulator
    emulator.stop()


@pytest.fixture(autouse=True)
def _no_azure_environment(monkeypatch):
    """Only the options say where and who (a test that means the environment sets it)."""
    for name in [n for n in os.environ if n.startswith(("AZURE", "AZURITE"))]:
        monkeypatch.delenv(name)


@pytest.fixture
def proxy(azurite: Azurite):
    p = FaultProxy(azurite.port, answers=AZURE_ANSWERS)
    yield p
    p.close()


def _upload(azurite: Azurite, folder: str | pathlib.Path) -> str:
    """A new container holding the folder's files under `data/`: its URL."""
    container = azurite.new_container()
    fs, _ = filesystem(f"az://{container}", storage_options(azurite.endpoint))
    fs.put(f"{folder}/", f"{container}/data/", recursive=True)
    return f"az://{container}/data"


def _files(azurite: Azurite, url: str) -> dict[str, bytes]:
    fs, base = filesystem(url, storage_options(azurite.endpoint))
    return {p.removeprefix(base + "/"): fs.cat_file(p) for p in fs.find(base)}


@pytest.fixture(scope="module")
def remote(azurite: Azurite, sa1b_dataset: str) -> str:
    return _upload(azurite, sa1b_dataset)


def _user_agents(proxy: FaultProxy) -> set[str]:
    return {r.headers.get("user-agent", "").split("/")[0] for r in proxy.requests if _is_shard_read(r)}


def _range(request) -> str | None:
    return request.headers.get("range") or request.headers.get("x-ms-range")  # (obstore's, adlfs's)


# Workers: 0, or 2 started by forkserver (obstore cannot run in a process forked from one where it ran,
# as this one has: there adlfs reads, as test_forked_loader_workers_... shows for a fresh process).
WORKERS = {"0": dict(num_workers=0), "2": dict(num_workers=2, multiprocessing_context="forkserver")}


@pytest.mark.parametrize("workers", WORKERS)
def test_stream_from_az_by_range_equals_local_disk(remote, sa1b_dataset, proxy, workers):
    local = _epoch(sa1b_dataset, **WORKERS[workers])
    _same(_epoch(remote, storage_options=storage_options(proxy.endpoint), **WORKERS[workers]), local)
    shard_gets = [r for r in proxy.gets() if _is_shard_read(r)]
    assert shard_gets and all(_range(r) for r in shard_gets), "every shard read by range"
    assert _user_agents(proxy) == {"object_store"}, "shards read by the lean client"


@pytest.mark.parametrize("workers", WORKERS)
def test_cache_fetches_each_shard_once_then_serves_locally(remote, sa1b_dataset, proxy, tmp_path, workers):
    options = dict(storage_options=storage_options(proxy.endpoint), cache_dir=str(tmp_path / "cache"),
                   cache_limit=1 << 30, **WORKERS[workers])
    local = _epoch(sa1b_dataset)
    _same(_epoch(remote, **options), local)  # cold (with 2 workers: two processes share the directory)
    manifest = Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(), "m")
    sizes = {s.name: s.bytes for s in manifest.splits["train"]}
    name = lambda r: r.target.split("?")[0].rsplit("/", 1)[1]  # noqa: E731
    whole = [name(r) for r in proxy.gets() if _range(r) == f"bytes=0-{sizes.get(name(r), 0) - 1}"]
    assert sorted(whole) == sorted(sizes), "each shard downloaded once, whole"
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.tar")) == \
        sorted(f"{s.sha256}.tar" for s in manifest.splits["train"])
    proxy.clear()
    _same(_epoch(remote, **options), local)  # warm: nothing but the manifest's HEAD
    assert [r.method for r in proxy.requests] == ["HEAD"], [(r.method, r.target) for r in proxy.requests]


def test_first_batch_reads_the_manifest_its_shards_indexes_and_its_samples_only(remote, sa1b_dataset, proxy):
    loader = make_stream_loader(remote, "train", batch_size=2, num_workers=0, read_ahead=0,
                                storage_options=storage_options(proxy.endpoint), **SMALL)
    batch = next(iter(loader))
    where = {k: (shard, index, i) for shard, index in indexed(sa1b_dataset) for i, k in enumerate(index.key_list())}
    touched = {where[k][0].name: where[k][0].index for k in batch["keys"]}
    needed = sum(int(where[k][1].spans[where[k][2]][1] - where[k][1].spans[where[k][2]][0]) for k in batch["keys"])
    gets = proxy.gets()
    names = sorted(r.target.split("?")[0].rsplit("/", 1)[1] for r in gets)
    tars = [n for n in names if n.endswith(".tar")]
    assert sorted(set(tars)) == sorted(touched) and len(tars) <= len(batch["keys"]), tars
    others = sorted(["manifest.json", *(i.name for i in touched.values())])
    assert [n for n in names if not n.endswith(".tar")] == others
    assert not [r for r in proxy.requests if r.method == "HEAD" and ".tar" in r.target], "sizes from the answers"
    allowed = len(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes()) + sum(i.bytes for i in touched.values()) \
        + 2.0 * needed + len(gets) * 1024  # (the default read_amplification)
    assert sum(r.response_bytes for r in gets) < allowed


def test_pack_to_az_with_the_environment_alone_is_byte_identical_to_local(sa1b_src, tmp_path, azurite,
                                                                          monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(azurite.endpoint))
    options = PackOptions(shard_samples=3, splits=(("train", 0.7), ("val", 0.3)), workers=2)
    out = f"az://{azurite.new_container()}/packed"
    pack(Sa1bSource(), [str(sa1b_src)], out, options, progress=False)
    pack(Sa1bSource(), [str(sa1b_src)], str(tmp_path / "local"), options, progress=False)
    local_files = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert _files(azurite, out) == local_files  # no `_pack` state left, manifest and shards equal
    manifest = Manifest.from_json(local_files["manifest.json"], "m")
    assert pack(Sa1bSource(), [str(sa1b_src)], out, options, progress=False).samples == \
        manifest.samples("train") + manifest.samples("val")  # (packing again: nothing to do)
    _same(_epoch(out), _epoch(str(tmp_path / "local")))


def test_the_emulator_from_the_environment_alone(remote, sa1b_dataset, azurite, monkeypatch):
    """AZURE_STORAGE_USE_EMULATOR (and AZURITE_BLOB_STORAGE_URL for its port), as obstore reads them: the
    manifest (adlfs) and the shards (the lean client) from the emulator, with no options."""
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", azurite.endpoint)
    _same(_epoch(remote), _epoch(sa1b_dataset))
    shard, _ = indexed(sa1b_dataset)[0]
    assert type(ranged_reader(f"{remote}/{shard.name}", None, FAST).client).__name__ == "AzureClient"


def test_pack_to_a_missing_container_and_no_account_are_clear_errors(sa1b_src, azurite):
    with pytest.raises(PackError, match="does the bucket exist"):
        pack(Sa1bSource(), [str(sa1b_src)], "az://no-such-container/x",
             PackOptions(storage_options=storage_options(azurite.endpoint)), progress=False)
    with pytest.raises(ConfigError, match=r"az://some/x: .*give the account in storage_options .*"
                                          r"AZURE_STORAGE_CONNECTION_STRING"):
        pack(Sa1bSource(), [str(sa1b_src)], "az://some/x", PackOptions(), progress=False)


def test_a_missing_adlfs_is_a_clear_error_not_a_traceback(remote, monkeypatch, caplog):
    registered = sys.modules["fsspec.registry"]._registry  # (fsspec's imported filesystem classes)
    for scheme in ("az", "abfs", "abfss"):
        monkeypatch.delitem(registered, scheme, raising=False)
    monkeypatch.setitem(sys.modules, "adlfs", None)  # (import adlfs: ImportError)
    with pytest.raises(ConfigError, match=r"az://x/y: reading or writing Azure Blob Storage needs adlfs .*"
                                          r"install the package's azure extra, or pip install 'adlfs>=2024.7'"):
        filesystem("az://x/y", {"account_name": "missing-adlfs"})
    assert main(["inspect", remote, "--storage-options", '{"account_name": "missing-adlfs"}']) == 2
    assert "install the package's azure extra, or pip install 'adlfs>=2024.7'" in caplog.text


def _told(given: str, azurite: Azurite, monkeypatch) -> list[str]:
    """The account for `shard-pack`: its `--storage-options`, or the environment alone (no flag)."""
    if given == "environment":
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(azurite.endpoint))
        return []
    return ["--storage-options", json.dumps(storage_options(azurite.endpoint))]


@pytest.mark.parametrize("given", ["options", "environment"])
def test_cli_reads_az_with_the_options_given_or_the_environment(remote, azurite, sa1b_dataset, tmp_path, capsys,
                                                                monkeypatch, given):
    assert main(["inspect", remote]) == 2, "no account in the options or the environment"
    options = _told(given, azurite, monkeypatch)
    capsys.readouterr()
    assert main(["inspect", remote, *options]) == 0
    assert "split train:" in capsys.readouterr().out
    assert main(["-q", "verify", remote, *options]) == 0
    assert capsys.readouterr().out.strip().endswith("verify: OK")
    argv = ["preview", remote, "--split", "train", "-n", "4", *SMALL_FLAGS]
    assert main([*argv, "--out", str(tmp_path / "az.png"), *options]) == 0
    assert main(["preview", sa1b_dataset, *argv[2:], "--out", str(tmp_path / "local.png")]) == 0
    assert (tmp_path / "az.png").read_bytes() == (tmp_path / "local.png").read_bytes()
    capsys.readouterr()
    assert main(["-q", "tune", remote, "--split", "train", "--batch-size", "2", "--workers", "0", "--batches", "2",
                 "--warmup", "1", *SMALL_FLAGS, *options]) == 0, "the measuring process reads az:// too"
    assert "recommended: num_workers=0" in capsys.readouterr().out


@pytest.mark.parametrize("given", ["options", "environment"])
def test_index_archives_on_az_into_az(azurite, sa1b_src, capsys, monkeypatch, given):
    url = _upload(azurite, sa1b_src)
    options = _told(given, azurite, monkeypatch)
    assert main(["-q", "index", "sa1b", url, f"{url}-index", "--workers", "2", *options]) == 0
    said = capsys.readouterr().out
    assert "indexed" in said and f"--allow-root {url}" in said
    assert main(["-q", "verify", f"{url}-index", "--allow-root", url, *options]) == 0


SMALL_FLAGS = ["--image-size", "32", "--mask-size", "8", "--max-masks", "2"]


# Fault tests: the same modes and bounds as s3://'s (tests/test_storage.py), with Azure's error answers.

@pytest.mark.parametrize("mode", ["slowdown", "error500", "reset", "cut"])
def test_transient_faults_are_retried_without_loss(remote, sa1b_dataset, proxy, mode):
    proxy.fault(mode, count=3, after_bytes=1000, match=_is_shard_read)
    _same(_epoch(remote, storage_options=storage_options(proxy.endpoint), retry=FAST), _epoch(sa1b_dataset))
    assert proxy.served(mode) == 3


# Options for each ranged client: the lean one (obstore), and adlfs (an option the lean one does not honour).
CLIENT_OPTIONS = {"lean": {}, "adlfs": {"timeout": 30}}
CAUSES = {"slowdown": r"(AzureError: 503 ServerBusy: Egress is over the account limit\.|HttpResponseError: .*Egress)",
          "error500": r"(AzureError: 500 InternalError: The server encountered|HttpResponseError: .*The server)",
          "reset": r"(ConnectionError|ServiceRequestError|ServiceResponseError)"}


@pytest.mark.parametrize("client", CLIENT_OPTIONS)
@pytest.mark.parametrize("mode", CAUSES)
def test_faults_past_the_bound_fail_naming_url_and_cause(remote, proxy, mode, client):
    proxy.fault(mode, count=1000, match=_is_shard_read)
    with pytest.raises(ShardError, match=rf"{remote}/train-\d+\.tar: sample .*after 4 tries: {CAUSES[mode]}"):
        _epoch(remote, storage_options=storage_options(proxy.endpoint, **CLIENT_OPTIONS[client]), retry=FAST,
               read_ahead=0, batch_size=1)
    assert _user_agents(proxy) == {"object_store" if client == "lean" else "adlfs"}
    if client == "adlfs" and mode == "reset":  # aiohttp repeats an idempotent request once when the connection drops
        assert proxy.served(mode) == 2 * 4
    else:
        assert proxy.served(mode) == 4, "exactly `attempts` tries: the clients' own retries are off"


def test_a_cut_long_read_resumes_from_the_piece_reached(remote, sa1b_dataset, proxy, monkeypatch):
    monkeypatch.setattr(storage.fs, "PIECE_BYTES", 4096)
    shard, _ = indexed(sa1b_dataset)[0]
    reader = ranged_reader(f"{remote}/{shard.name}", storage_options(proxy.endpoint), FAST)
    nth = iter(range(100))
    proxy.fault("cut", count=1, after_bytes=1000, match=lambda r: next(nth) == 2)  # the third piece
    assert reader.read(0, shard.bytes) == pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    pieces = [f"bytes={i}-{min(i + 4096, shard.bytes) - 1}" for i in range(0, shard.bytes, 4096)]
    assert [_range(r) for r in proxy.gets()] == pieces[:3] + pieces[2:]  # only the cut piece is asked for twice


def test_stall_past_the_read_timeout_is_retried(remote, sa1b_dataset, proxy):
    proxy.fault("stall", count=1, seconds=4, match=_is_shard_read)
    options = storage_options(proxy.endpoint, read_timeout=1, connection_timeout=1)
    _same(_epoch(remote, storage_options=options, retry=FAST), _epoch(sa1b_dataset))
    assert proxy.served("stall") == 1


def test_a_cut_stream_resumes_from_the_byte_reached(remote, sa1b_dataset, proxy, monkeypatch):
    monkeypatch.setattr(storage.s3, "STREAM_CHUNK", 256)
    shard, _ = indexed(sa1b_dataset)[0]
    reader = ranged_reader(f"{remote}/{shard.name}", storage_options(proxy.endpoint), FAST)
    proxy.fault("cut", count=1, after_bytes=1000, match=_is_shard_read)
    assert b"".join(bytes(c) for c in reader.stream(0, shard.bytes)) == \
        pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    first, second = (r.headers["range"] for r in proxy.gets())
    resumed = int(second.removeprefix("bytes=").split("-")[0])
    assert first == f"bytes=0-{shard.bytes - 1}" and 0 < resumed <= 1000, (first, second)


def test_an_epoch_under_30_percent_throttling_finishes(remote, sa1b_dataset, proxy):
    gets = itertools.count()
    proxy.fault("slowdown", count=1 << 30, match=lambda r: r.method == "GET" and next(gets) % 10 < 3)
    retry = Retry(attempts=1, initial_delay=0.01, max_delay=0.05, throttle_seconds=30)
    result = _epoch(remote, storage_options=storage_options(proxy.endpoint), retry=retry, num_workers=2,
                    read_ahead_bytes=0)
    _same(result, _epoch(sa1b_dataset))
    assert proxy.served("slowdown") >= 0.25 * len(proxy.gets()) >= 5


def test_throttling_past_its_time_budget_fails_naming_it(remote, proxy, monkeypatch):
    reader = ranged_reader(f"{remote}/train-000000.tar", storage_options(proxy.endpoint),
                           Retry(attempts=2, initial_delay=0.125, max_delay=0.25, throttle_seconds=1.0))
    proxy.fault("slowdown", count=1000)
    clock = _RetryClock()
    monkeypatch.setattr(storage.retry, "time", clock)
    monkeypatch.setattr(storage.retry, "random", clock)
    with pytest.raises(ShardError, match=r"cannot read bytes 0-100 after 6 tries over 1\.1 s of throttling "
                                         r"\(throttle_seconds=1\): AzureError: 503 ServerBusy"):
        reader.read(0, 100)
    assert proxy.served("slowdown") == 6


def test_a_shard_changed_upstream_at_the_same_size_is_an_error_with_the_cache(azurite, sa1b_dataset, tmp_path):
    source = _upload(azurite, sa1b_dataset)
    shard, index = indexed(sa1b_dataset)[1]
    data = bytearray(pathlib.Path(sa1b_dataset, shard.name).read_bytes())
    data[index.span(0)[0] + 512 + 15] ^= 0x01  # (the JPEG's pixel density: it still decodes)
    fs, base = filesystem(source, storage_options(azurite.endpoint))
    fs.pipe_file(f"{base}/{shard.name}", bytes(data))
    options = dict(storage_options=storage_options(azurite.endpoint), cache_dir=str(tmp_path / "cache"),
                   cache_limit=1 << 30)
    with pytest.raises(ShardError, match=rf"{source}/{shard.name}: .*downloaded shard has SHA-256 [0-9a-f]{{64}}, "
                                         "the manifest says"):
        _epoch(source, **options)


@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_a_shard_resized_upstream_is_named_by_its_sizes(azurite, sa1b_dataset, proxy, change):
    source = _upload(azurite, sa1b_dataset)
    shard, index = indexed(sa1b_dataset)[1]
    data = pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    changed = data + bytes(1024) if change == "longer" else data[: index.span(len(index.key_list()) - 1)[0] + 600]
    fs, base = filesystem(source, storage_options(azurite.endpoint))
    fs.pipe_file(f"{base}/{shard.name}", changed)
    with pytest.raises(ShardError, match=rf"{source}/{shard.name}: sample '[^']+': shard is {len(changed)} bytes, "
                                         rf"the manifest says {len(data)}"):
        _epoch(source, storage_options=storage_options(proxy.endpoint), shuffle=False)
    proxy.clear()
    loader = make_stream_loader(source, "train", batch_size=2, num_workers=0, seed=5, on_error="skip", drop_last=False,
                                storage_options=storage_options(proxy.endpoint), **SMALL)
    seen = [k for batch in loader for k in batch["keys"]]
    assert sorted(seen) == sorted(set(split_keys(sa1b_dataset)) - set(index.key_list()))
    assert not [r.target for r in proxy.requests if r.method == "HEAD" and ".tar" in r.target], "sizes from answers"


def test_refused_credentials_fail_at_once_naming_the_shard_and_sample(remote, sa1b_dataset, azurite):
    shard, index = indexed(sa1b_dataset)[0]
    start, end = index.span(0)
    wrong = {"connection_string": connection_string(azurite.endpoint).replace("AccountKey=Eby8", "AccountKey=Xby8")}
    way = storage.ShardReader(remote, wrong, FAST).way(shard)
    url = f"{remote}/{shard.name}"
    with pytest.raises(ShardError, match=rf"{url}: sample '{index.key(0)}': cannot read bytes {start}-{end}: "
                                         r"PermissionError: 403 AuthorizationFailure"):  # (no "after 4 tries")
        with about_sample(url, index.key(0)):
            way.read(start, end)
    with pytest.raises(ManifestError, match=f"{remote}/manifest.json: access denied"):
        make_stream_loader(remote, "train", batch_size=2, num_workers=0, storage_options=wrong, **SMALL)
    with pytest.raises(ManifestError, match="no manifest: .*bucket does not exist"):
        make_stream_loader("az://no-such-container/sa1b", "train", batch_size=2, num_workers=0,
                           storage_options=storage_options(azurite.endpoint), **SMALL)


def test_verify_reads_each_shard_once_by_one_stream(remote, sa1b_dataset, proxy):
    assert verify(remote, progress=False, storage_options=storage_options(proxy.endpoint)) == []
    names = [r.target.split("?")[0].rsplit("/", 1)[1] for r in proxy.gets() if _is_shard_read(r)]
    assert names and all(names.count(n) == 1 for n in names)
    assert _user_agents(proxy) == {"object_store"}


def test_options_the_lean_client_cannot_honour_leave_the_shards_to_adlfs(remote, sa1b_dataset, proxy, caplog):
    caplog.set_level(logging.DEBUG, "pipeline.storage")
    _same(_epoch(remote, storage_options=storage_options(proxy.endpoint, max_concurrency=2, timeout=30)),
          _epoch(sa1b_dataset))
    assert "read through adlfs, not the lean client: options timeout" in caplog.text
    assert "object_store" not in _user_agents(proxy)


# A training process whose 2 DataLoader workers are forked: each makes its own lean client.
_FORKED_WORKERS = r"""
import json, logging, sys
from pipeline import make_stream_loader
logging.basicConfig(level=logging.WARNING, format="%(process)d %(name)s %(message)s")
logging.getLogger("pipeline.storage").setLevel(logging.DEBUG)
loader = make_stream_loader(sys.argv[1], "train", batch_size=2, num_workers=2, seed=5, multiprocessing_context="fork",
                            storage_options={"connection_string": sys.argv[2]}, image_size=32, mask_size=8, max_masks=2)
loader.set_epoch(1)
print(json.dumps([b["keys"] for b in loader]))
"""


def test_forked_loader_workers_each_read_through_their_own_lean_client(remote, sa1b_dataset, azurite):
    run = subprocess.run([sys.executable, "-c", _FORKED_WORKERS, remote, connection_string(azurite.endpoint)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count(": lean client made in process") == 2 and "read through adlfs" not in run.stderr
    assert json.loads(run.stdout) == [b["keys"] for b in _epoch(sa1b_dataset, num_workers=2)]


def test_abfs_urls_are_the_same_blobs_and_keep_their_scheme(remote, sa1b_dataset, azurite):
    shard, _ = indexed(sa1b_dataset)[0]
    url = remote.replace("az://", "abfs://", 1)
    reader = ranged_reader(f"{url}/{shard.name}", storage_options(azurite.endpoint), FAST)
    assert type(reader.client).__name__ == "AzureClient"
    assert reader.read(0, 1000) == pathlib.Path(sa1b_dataset, shard.name).read_bytes()[:1000]
    for scheme in ("az", "abfs"):
        fs, path = filesystem(remote.replace("az://", f"{scheme}://", 1), storage_options(azurite.endpoint))
        assert fs.unstrip_protocol(path) == remote.replace("az://", f"{scheme}://", 1), "URLs it names: as given"


_ACCOUNT = {"account_name": "acct", "endpoint": "https://acct.blob.core.windows.net"}


@pytest.mark.parametrize(("options", "expected"), [
    ({"connection_string": f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={EMULATOR_KEY};"
                           "EndpointSuffix=core.windows.net"}, {**_ACCOUNT, "credential_type": "access_key"}),
    ({"connection_string": f"AccountName=acct;AccountKey={EMULATOR_KEY}"},
     {**_ACCOUNT, "credential_type": "access_key"}),
    ({"connection_string": "AccountName=acct;SharedAccessSignature=sv=1&sig=x;BlobEndpoint=https://h.example/"},
     {"account_name": "acct", "endpoint": "https://h.example", "credential_type": "sas_token",
      "sas_key": "sv=1&sig=x"}),
    ({"connection_string": "UseDevelopmentStorage=true"},
     {"account_name": "devstoreaccount1", "endpoint": "http://127.0.0.1:10000/devstoreaccount1"}),
    ({"account_name": "acct", "sas_token": "?sv=1&sig=x"}, {**_ACCOUNT, "sas_key": "sv=1&sig=x"}),
    ({"account_name": "acct", "anon": True}, {**_ACCOUNT, "skip_signature": "true"}),
    ({"account_name": "acct", "account_host": "acct.blob.core.chinacloudapi.cn", "account_key": EMULATOR_KEY},
     {"endpoint": "https://acct.blob.core.chinacloudapi.cn", "credential_type": "access_key"}),
], ids=["connection-string", "connection-string-defaults", "connection-string-sas", "development-storage", "sas",
        "anonymous", "account-host"])
def test_the_lean_client_reads_the_account_adlfs_would(options, expected, monkeypatch):
    """Settings obstore would take from the environment (a token, an endpoint, the emulator) are given
    it from adlfs's view: none of them can send the lean client elsewhere. (Nothing is contacted.)"""
    for name, value in {"AZURE_STORAGE_TOKEN": "t", "AZURE_STORAGE_ENDPOINT": "http://127.0.0.1:9",
                        "AZURE_STORAGE_USE_EMULATOR": "true"}.items():
        monkeypatch.setenv(name, value)
    made, key = azure_client("az://box/a/b.tar", options)
    assert key == "a/b.tar" and made.store.config["use_emulator"] == "false"
    assert {name: made.store.config.get(name) for name in expected} == expected


@pytest.mark.parametrize(("options", "reason"), [
    ({"account_name": "acct"}, "no key, SAS token or anonymous access"),
    ({"account_name": "acct", "client_id": "i", "client_secret": "s", "tenant_id": "t"}, "a service principal"),
    ({"account_name": "acct", "account_key": EMULATOR_KEY, "credential": "k"}, "a credential object"),
    ({"connection_string": "BlobEndpoint=https://h.example;SharedAccessSignature=x"},
     "a connection string without AccountName"),
])
def test_what_the_lean_client_cannot_read_as_adlfs_would_is_left_to_adlfs(options, reason, caplog):
    caplog.set_level(logging.DEBUG, "pipeline.storage")
    assert azure_client("az://box/a/b.tar", options) is None
    assert f"read through adlfs, not the lean client: {reason}" in caplog.text


def _azure_core_error(name: str, status: int | None) -> Exception:
    import azure.core.exceptions

    error = getattr(azure.core.exceptions, name)("message")
    error.status_code = status  # (as an answer's status sets it)
    return error


@pytest.mark.parametrize(("error", "is_transient", "is_throttled"), [
    (lambda: _azure_core_error("HttpResponseError", 503), True, True),  # ServerBusy, through adlfs
    (lambda: _azure_core_error("HttpResponseError", 500), True, False),
    (lambda: _azure_core_error("ServiceRequestError", None), True, False),  # no connection, a reset
    (lambda: _azure_core_error("ServiceResponseError", None), True, False),
    (lambda: _azure_core_error("ClientAuthenticationError", 403), False, False),
    (lambda: _azure_core_error("ResourceNotFoundError", 404), False, False),
    (lambda: AzureError(503, "ServerBusy", "Egress is over the account limit."), True, True),  # the lean client's
    (lambda: AzureError(416, "InvalidRange", "The range specified is invalid"), False, False),
], ids=["adlfs-503", "adlfs-500", "adlfs-request", "adlfs-response", "adlfs-403", "adlfs-404", "lean-503", "lean-416"])
def test_azure_failures_are_classified_for_retry(error, is_transient, is_throttled):
    assert (transient(error()), throttled(error())) == (is_transient, is_throttled)
