"""A local Azure Blob Storage emulator for the tests and the benchmarks: Azurite (npm, installed into
the checkout's `emulators/azurite/` by `make`), its blob service listening on 127.0.0.1 only, with
the emulator's well-known development account."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from pipeline.storage.azure import EMULATOR_ACCOUNT, EMULATOR_KEY
from shard_tools.samples.locals3 import HOST, free_ports

__all__ = ["Azurite", "connection_string", "storage_options"]

_INSTALLED = pathlib.Path(__file__).resolve().parents[2] / "emulators" / "azurite" / "node_modules" / ".bin"


def _azurite() -> str:
    found = _INSTALLED / "azurite-blob"
    path = str(found) if found.exists() else shutil.which("azurite-blob")
    if path is None:
        raise RuntimeError("Azurite is missing: `make` installs it (npm ci --prefix emulators/azurite; node and npm "
                           "needed)")
    return path


def connection_string(endpoint: str) -> str:
    """The development account's connection string for a blob service at `endpoint` (Azurite, or a proxy)."""
    return (f"DefaultEndpointsProtocol=http;AccountName={EMULATOR_ACCOUNT};AccountKey={EMULATOR_KEY};"
            f"BlobEndpoint={endpoint}/{EMULATOR_ACCOUNT};")


def storage_options(endpoint: str, **options: Any) -> dict[str, Any]:
    """adlfs options for the blob service at `endpoint`; `options` added (e.g. read_timeout=1)."""
    return {"connection_string": connection_string(endpoint), **options}


class Azurite:
    """Azurite's blob service on a free loopback port, its blobs in memory (its output in `directory`)."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory.resolve()
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, timeout: float = 60.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.port,) = free_ports(1)
        args = [_azurite(), "--blobHost", HOST, "--blobPort", str(self.port),
                "--inMemoryPersistence", "--loose", "--skipApiVersionCheck", "--disableProductStyleUrl",
                "--disableTelemetry", "--silent"]
        self.log = open(self.directory / "azurite.log", "wb")  # closed in stop()
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.directory,
                                        env={"PATH": os.environ.get("PATH", ""), "HOME": str(self.directory)})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                urllib.request.urlopen(f"{self.endpoint}/{EMULATOR_ACCOUNT}?comp=list", timeout=1)
                return
            except urllib.error.HTTPError:  # an error answer (403: unsigned): the service is up
                return
            except OSError:
                time.sleep(0.2)
        tail = (self.directory / "azurite.log").read_bytes()[-3000:].decode(errors="replace")
        self.stop()
        raise RuntimeError(f"Azurite did not start within {timeout} s:\n{tail}")

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def new_container(self) -> str:
        """A new empty container: its name."""
        from azure.storage.blob import BlobServiceClient

        name = f"t{uuid.uuid4().hex[:12]}"
        with BlobServiceClient.from_connection_string(connection_string(self.endpoint)) as service:
            service.create_container(name)
        return name

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
