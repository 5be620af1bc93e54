"""A local Azure Blob Storage emulator for the tests and the benchmarks: Azurite (npm, installed into
the checkout's `emulators/azurite/` by `make`), its blob service listening on 127.0.0.1 only, with
the emulator's well-known development account."""

from __future__ import annotations

import pathlib
import shutil
import uuid
from typing import Any

from pipeline.storage.azure import EMULATOR_ACCOUNT, EMULATOR_KEY
from shard_tools.samples.locals3 import HOST, LocalServer, free_ports

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


class Azurite(LocalServer):
    """Azurite's blob service on a free loopback port, its blobs in memory (its output in `directory`)."""

    NAME, LOG = "Azurite", "azurite.log"

    def command(self) -> list[str]:
        (self.port,) = free_ports(1)
        return [_azurite(), "--blobHost", HOST, "--blobPort", str(self.port), "--inMemoryPersistence", "--loose",
                "--skipApiVersionCheck", "--disableProductStyleUrl", "--disableTelemetry", "--silent"]

    def ready_url(self) -> str:
        return f"{self.endpoint}/{EMULATOR_ACCOUNT}?comp=list"

    def new_container(self) -> str:
        """A new empty container: its name."""
        from azure.storage.blob import BlobServiceClient

        name = f"t{uuid.uuid4().hex[:12]}"
        with BlobServiceClient.from_connection_string(connection_string(self.endpoint)) as service:
            service.create_container(name)
        return name
