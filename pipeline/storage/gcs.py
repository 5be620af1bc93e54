"""Google Cloud Storage (`gs://bucket/key`, also `gcs://`): the lean ranged client through obstore
(`s3.S3Client` over a GCSStore, Google's XML API: ranges, sizes and streams, every answer saying
the object's size), and gcsfs's filesystem for everything else (listing, writes, the manifest),
trying each request once: `retry.Retry` is the one retry layer.

Both take gcsfs's `storage_options` and the environment gcsfs and google-auth read: the lean client
is configured from the filesystem gcsfs makes of them, so it goes where gcsfs goes (`endpoint_url`,
else STORAGE_EMULATOR_HOST, else Google's endpoint) as whom gcsfs resolves (`token`, else
GOOGLE_APPLICATION_CREDENTIALS, gcloud's application default credentials or the metadata server,
else anonymous), its tokens refreshed by google-auth before they expire. What it cannot honour
(requester pays, gcsfs's HTTP session settings, a client certificate) makes it decline (logged at
DEBUG), and gcsfs reads the shards too."""

from __future__ import annotations

import datetime
from typing import Any

from fsspec import AbstractFileSystem

from pipeline.errors import ConfigError
from pipeline.storage.s3 import Declined, S3Client, S3Error, made_once, unusable

__all__ = ["ENVIRONMENT", "GCSClient", "GCSError", "SCHEMES", "client", "filesystem"]

SCHEMES = ("gs", "gcs")
# The environment gcsfs and google-auth read when a filesystem is made (names starting so).
ENVIRONMENT = ("GOOGLE_", "STORAGE_EMULATOR_HOST", "CLOUDSDK_", "GCSFS_")
_EXTRA = "install the package's gcs extra, or pip install 'gcsfs>=2024.2' 'obstore>=0.12,<0.13'"
# gcsfs options that change nothing in a ranged read or a size (listing, caching, uploads, other buckets).
_NO_EFFECT = {"project", "block_size", "consistency", "cache_timeout", "secure_serialize", "check_connection",
              "default_location", "version_aware", "skip_instance_cache", "use_listings_cache", "listings_expiry_time",
              "max_paths", "timeout", "finalize_on_close", "mrd_pool_cache_size", "max_mrd_pool_cache_queue_size",
              "memmove_max_workers", "retry_timeout", "retry_initial", "retry_maximum", "retry_multiplier"}
_KNOWN = {"access", "token", "endpoint_url", "requests_timeout", "requester_pays", "session_kwargs"}
_REFRESH_SECONDS = 600  # a token with less left is refreshed when obstore asks (it asks 5 minutes before expiry)


class GCSError(S3Error):
    """An error answer of Google Cloud Storage: its HTTP status, error code (XML API) and message."""


class GCSClient(S3Client):
    """`s3.S3Client`'s ranged reads, sizes and streams over one bucket's objects (an obstore GCSStore)."""

    scheme, error = "gs", GCSError


def client(url: str, storage_options: dict[str, Any] | None) -> tuple[GCSClient, str] | None:
    """The lean client of a `gs://` URL's bucket and the object's name in it, made once per process,
    options and environment; None where it cannot read as gcsfs would (the reason logged at DEBUG):
    then gcsfs reads."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")

    def make(options: dict[str, Any]) -> GCSClient:
        made = GCSClient(_store(url, bucket, options), bucket)
        made.scheme = scheme
        return made

    return made_once(url, storage_options, (ENVIRONMENT, "gcsfs"), _unusable(bucket, key), make)  # type: ignore


def filesystem(url: str, storage_options: dict[str, Any]) -> AbstractFileSystem:
    """gcsfs's filesystem for the URL, its own instance (its listings cache off), trying each request
    once, each bounded by `requests_timeout` (default 300 s, as the lean client's: gcsfs's own default,
    None, lets a request whose answer never comes wait forever); a ConfigError naming the URL where
    gcsfs is missing."""
    options = {"skip_instance_cache": True, "use_listings_cache": False, **storage_options}
    options["requests_timeout"] = options.get("requests_timeout") or 300.0
    try:
        one_try = _one_try()
    except ImportError as exc:
        raise ConfigError(f"{url}: reading or writing Google Cloud Storage needs gcsfs ({exc}): {_EXTRA}") from exc
    return one_try(**options)


def _one_try() -> type:
    """gcsfs's GCSFileSystem trying each request once. Its own loop (6 tries, waits of up to 32 s) is
    fixed where its methods are defined, and no option turns it off. It is also the plain class, not
    the ExtendedGcsFileSystem that gcsfs registers for gs:// by default: that one asks the Storage
    Control API (gRPC) for each bucket's layout, for up to 60 s where nothing answers it (an emulator),
    to serve zonal buckets, which obstore's XML reads do not either. And 403 Forbidden, which gcsfs
    raises as a bare OSError, is a PermissionError here (not tried again)."""
    if not _CLASS:
        from gcsfs.core import GCSFileSystem

        once = GCSFileSystem._request.__wrapped__  # type: ignore[attr-defined]

        class OneTry(GCSFileSystem):  # type: ignore[misc]
            _get_file_request = GCSFileSystem._get_file_request.__wrapped__  # type: ignore[attr-defined]
            _get_file_concurrent = GCSFileSystem._get_file_concurrent.__wrapped__  # type: ignore[attr-defined]

            async def _request(self, *args: Any, **kwargs: Any) -> Any:
                try:
                    return await once(self, *args, **kwargs)
                except OSError as exc:
                    if type(exc) is OSError and str(exc).startswith("Forbidden: "):
                        raise PermissionError(str(exc)) from exc
                    raise

        _CLASS.append(OneTry)
    return _CLASS[0]


_CLASS: list[type] = []  # the one-try class, made on first use (gcsfs is imported only for gs://)


def _unusable(bucket: str, key: str) -> str | None:
    return unusable(None if bucket else "no bucket", key, ("object name", "gcsfs"), _EXTRA)


def _store(url: str, bucket: str, options: dict[str, Any]) -> Any:
    """An obstore GCSStore for the bucket, at the endpoint and with the credentials gcsfs resolves from
    the same options and environment; every setting obstore would otherwise take from the environment
    given here. Declined for what it cannot honour."""
    from obstore.store import GCSStore

    unknown = sorted(set(options) - _NO_EFFECT - _KNOWN)
    if unknown:
        raise Declined(f"options {', '.join(unknown)}")
    if options.get("requester_pays"):
        raise Declined("requester_pays (obstore sends no userProject)")
    if options.get("session_kwargs"):
        raise Declined("session_kwargs (gcsfs's HTTP session settings)")
    fs: Any = filesystem(url, options)
    if fs._use_client_cert:
        raise Declined("a client certificate (gcsfs presents it, obstore does not)")
    endpoint = fs._location.rstrip("/")  # (endpoint_url, else STORAGE_EMULATOR_HOST, else Google's)
    anonymous = fs.credentials.credentials is None
    config = {"bucket": bucket, "base_url": endpoint, "skip_signature": anonymous}
    seconds = options.get("requests_timeout") or 300.0  # (aiohttp's default bound of a whole request, as gcsfs has it)
    client_options = {"allow_http": endpoint.startswith("http://"), "timeout": datetime.timedelta(seconds=seconds),
                      "connect_timeout": datetime.timedelta(seconds=min(seconds, 30.0))}
    no_retries = {"max_retries": 0}  # (retry.Retry is the one retry layer)
    return GCSStore(config=config, client_options=client_options, retry_config=no_retries,  # type: ignore[arg-type]
                    credential_provider=None if anonymous else _Token(fs.credentials))


class _Token:
    """obstore's credential provider over gcsfs's credentials (google-auth's underneath): a token with
    less than `_REFRESH_SECONDS` left is refreshed first."""

    def __init__(self, credentials: Any) -> None:
        self.credentials = credentials

    def __call__(self) -> dict[str, Any]:
        self.credentials.maybe_refresh(refresh_buffer=_REFRESH_SECONDS)
        found = self.credentials.credentials
        expiry = found.expiry  # (google-auth's: naive UTC; None: never expires)
        return {"token": found.token,
                "expires_at": None if expiry is None else expiry.replace(tzinfo=datetime.timezone.utc)}
