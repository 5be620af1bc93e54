"""A fault-injecting HTTP proxy for the object-storage tests, on 127.0.0.1 in front of the local
SeaweedFS server (`shard_tools.samples.locals3`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import socket
import threading
import time
from collections.abc import Callable

from shard_tools.samples.locals3 import HOST, KEY, SECRET


@dataclasses.dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    fault: str | None = None
    response_bytes: int = 0
    at: float = dataclasses.field(default_factory=time.monotonic)  # when its head arrived

    @property
    def access_key(self) -> str | None:
        """The access key ID that signed it (SigV4), if any."""
        found = re.search(r"Credential=([^/]+)/", self.headers.get("authorization", ""))
        return found.group(1) if found else None


@dataclasses.dataclass
class _Fault:
    mode: str  # "slowdown", "error500", "cut", "reset", "stall", "delay"
    count: int
    after_bytes: int
    seconds: float
    match: Callable[[Request], bool]


SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n")
SLOWDOWN_BODY = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>'
ERROR500 = (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n")
ERROR500_BODY = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>'
EXPIRED = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n")
EXPIRED_BODY = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ExpiredToken</Code><Message>The provided token has expired.</Message></Error>'
UNKNOWN_KEY = (b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n")
UNKNOWN_KEY_BODY = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>'

# What "slowdown" and "error500" answer (the response head with a %d for the body's length, the body):
# S3's by default; a scheme whose server speaks otherwise passes its own to FaultProxy(answers=...).
S3_ANSWERS = {"slowdown": (SLOWDOWN, SLOWDOWN_BODY), "error500": (ERROR500, ERROR500_BODY)}


class FaultProxy:
    """HTTP proxy on 127.0.0.1 in front of the server, one request per connection, that records every
    request and injects faults into the next `count` requests that `match`:
    - "slowdown": answers 503 SlowDown; "error500": answers 500 InternalError (the server never sees them;
      `answers` gives another server's words for both, and may name more modes answered so);
    - "cut": relays the response head and `after_bytes` of the body, then closes the connection;
    - "reset": resets the connection (RST) before answering;
    - "stall": holds the connection silent for `seconds`, then closes it;
    - "delay": waits `seconds`, then passes the request on (a slow answer, not a failure).

    With `credentials` (access key ID -> "valid", "expired" or anything else), it plays a server that
    issues temporary credentials: a request signed with an expired one is answered 400 ExpiredToken,
    with an unknown one 403 InvalidAccessKeyId (fault "expired", "unknown"), and one signed with a
    valid one is signed again with the server's own key and passed on (signatures are not checked)."""

    def __init__(self, upstream_port: int, credentials: Callable[[str | None], str] | None = None,
                 answers: dict[str, tuple[bytes, bytes]] = S3_ANSWERS) -> None:
        self.upstream_port, self.answers = upstream_port, answers
        self.credentials = credentials
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
        assert mode in ("cut", "reset", "stall", "delay") or mode in self.answers, mode
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
        state = self.credentials(request.access_key) if self.credentials is not None else "valid"
        if state != "valid":
            with self._lock:
                request.fault = "expired" if state == "expired" else "unknown"
                self.requests.append(request)
            head, payload = (EXPIRED, EXPIRED_BODY) if state == "expired" else (UNKNOWN_KEY, UNKNOWN_KEY_BODY)
            with contextlib.suppress(ConnectionError):
                writer.write(head % len(payload) + payload)
                await writer.drain()
            writer.close()
            return
        if self.credentials is not None:
            lines = self._signed_again(lines, method, target)
        fault = self._take_fault(request)
        try:
            if fault is not None and fault.mode in self.answers:
                answer, payload = self.answers[fault.mode]
                writer.write(answer % len(payload) + payload)
                await writer.drain()
            elif fault is not None and fault.mode == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                writer.transport.abort()
                return
            elif fault is not None and fault.mode == "stall":
                await asyncio.sleep(fault.seconds)
            else:
                if fault is not None and fault.mode == "delay":
                    await asyncio.sleep(fault.seconds)
                cut = fault if fault is not None and fault.mode == "cut" else None
                await self._forward(lines, body, writer, request, cut)
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _signed_again(self, lines: list[str], method: str, target: str) -> list[str]:
        """The request's head signed with the server's key (SigV4; GET and HEAD: no body)."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        signing = ("authorization", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token", "host")
        kept = [line for line in lines[1:] if line and line.split(":", 1)[0].strip().lower() not in signing]
        request = AWSRequest(method=method, url=f"http://{HOST}:{self.port}{target}",
                             headers={k.strip(): v.strip() for k, v in (line.split(":", 1) for line in kept)})
        S3SigV4Auth(Credentials(KEY, SECRET), "s3", "us-east-1").add_auth(request)
        return [lines[0], f"host: {HOST}:{self.port}", *(f"{k}: {v}" for k, v in request.headers.items())]

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
