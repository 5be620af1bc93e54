"""Azure Blob Storage (`az://container/key`; also adlfs's `abfs://` and `abfss://`): the lean ranged
client through obstore (`s3.S3Client` over an AzureStore: ranges, sizes and streams, every answer
saying the object's size), and adlfs's filesystem for everything else (listing, writes, the
manifest), with azure-storage-blob's own retries off: `retry.Retry` is the one retry layer.

Both take adlfs's `storage_options` and the environment adlfs reads: a connection string
(AZURE_STORAGE_CONNECTION_STRING), or an account (AZURE_STORAGE_ACCOUNT_NAME) with its key
(AZURE_STORAGE_ACCOUNT_KEY), a SAS token (AZURE_STORAGE_SAS_TOKEN) or anonymous access
(AZURE_STORAGE_ANON). AZURE_STORAGE_USE_EMULATOR (obstore's; the emulator at
AZURITE_BLOB_STORAGE_URL, else http://127.0.0.1:10000) stands for the emulator's well-known
account where nothing else names one, for both. What the lean client cannot read as adlfs would
(an account given as a credential object, a service principal, azure-identity's default chain)
makes it decline (logged at DEBUG), and adlfs reads the shards too."""

from __future__ import annotations

import datetime
import os
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from pipeline.errors import ConfigError
from pipeline.storage.s3 import Declined, S3Client, S3Error, made_once, unusable

__all__ = ["AzureClient", "AzureError", "EMULATOR_ACCOUNT", "EMULATOR_KEY", "SCHEMES", "client", "emulator_options",
           "filesystem"]

SCHEMES = ("az", "abfs", "abfss")
# Azurite's well-known development account (public: the emulator's documentation and every Azure SDK name it).
EMULATOR_ACCOUNT = "devstoreaccount1"
EMULATOR_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_EXTRA = "install the package's azure extra, or pip install 'adlfs>=2024.7' 'obstore>=0.12,<0.13'"
_ACCOUNT_HELP = ("storage_options (connection_string, or account_name with account_key or sas_token), or the "
                 "environment: AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
                 "AZURE_STORAGE_ACCOUNT_KEY, or AZURE_STORAGE_USE_EMULATOR for Azurite")
# adlfs options that change nothing in a ranged read or a HEAD (listing, caching, uploads).
_NO_EFFECT = {"blocksize", "default_fill_cache", "default_cache_type", "assume_container_exists", "max_concurrency",
              "use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "asynchronous",
              "version_aware", "client_id", "client_secret", "tenant_id"}  # (a service principal: declined below)
_KNOWN = {"account_name", "account_key", "connection_string", "sas_token", "anon", "account_host", "credential",
          "location_mode", "connection_timeout", "read_timeout"}
_TRUE = ("true", "1", "yes", "y", "on")  # (obstore's truthy values)


class AzureError(S3Error):
    """An error answer of Azure Blob Storage: its HTTP status, error code (e.g. ServerBusy) and message."""


class AzureClient(S3Client):
    """`s3.S3Client`'s ranged reads, sizes and streams over one container's blobs (an obstore AzureStore)."""

    scheme, error = "az", AzureError


def client(url: str, storage_options: dict[str, Any] | None) -> tuple[AzureClient, str] | None:
    """The lean client of an `az://` URL's container and the blob's name in it, made once per process,
    options and AZURE* environment; None where it cannot read as adlfs would (the reason logged at
    DEBUG): then adlfs reads."""
    scheme, _, rest = url.partition("://")
    container, _, key = rest.partition("/")

    def make(options: dict[str, Any]) -> AzureClient:
        made = AzureClient(_store(container, emulator_options(options)), container)
        made.scheme = scheme
        return made

    return made_once(url, storage_options, ("AZURE", "adlfs"), _unusable(container, key), make)  # type: ignore


def filesystem(url: str, storage_options: dict[str, Any]) -> AbstractFileSystem:
    """adlfs's filesystem for the URL, its own instance (its listings cache off), with azure-storage-blob's
    retries off, and the URL's scheme first among its protocols (adlfs names every URL it makes `abfs://`);
    a ConfigError naming the URL where adlfs is missing or no account is given."""
    options = {"skip_instance_cache": True, "use_listings_cache": False, **emulator_options(storage_options)}
    try:
        fs, _ = url_to_fs(url, **options)
    except ImportError as exc:
        raise ConfigError(f"{url}: reading or writing Azure Blob Storage needs adlfs ({exc}): {_EXTRA}") from exc
    except ValueError as exc:  # (no account, a malformed connection string)
        raise ConfigError(f"{url}: {exc}; give the account in {_ACCOUNT_HELP}") from exc
    fs.service_client._config.retry_policy.total_retries = 0  # (its pipeline's policy: every client of the fs)
    scheme = url.partition("://")[0]
    fs.protocol = (scheme, *(other for other in fs.protocol if other != scheme))  # (URLs it makes: the scheme given)
    return fs


def emulator_options(options: dict[str, Any]) -> dict[str, Any]:
    """adlfs's options, with the emulator's connection string where AZURE_STORAGE_USE_EMULATOR asks for it
    and neither the options nor the environment name an account (adlfs does not read that variable)."""
    named = options.get("connection_string") or options.get("account_name") or \
        os.environ.get("AZURE_STORAGE_CONNECTION_STRING") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if named or os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() not in _TRUE:
        return options
    where = os.environ.get("AZURITE_BLOB_STORAGE_URL", "http://127.0.0.1:10000").rstrip("/")
    return {**options, "connection_string": f"DefaultEndpointsProtocol=http;AccountName={EMULATOR_ACCOUNT};"
                                            f"AccountKey={EMULATOR_KEY};BlobEndpoint={where}/{EMULATOR_ACCOUNT};"}


def _unusable(container: str, key: str) -> str | None:
    where = None if container and "@" not in container else f"container {container!r} (none, or an account in the URL)"
    return unusable(where, key, ("blob name", "adlfs"), _EXTRA)


def _store(container: str, options: dict[str, Any]) -> Any:
    """An obstore AzureStore for the container, its account, endpoint and credentials as adlfs resolves
    them; every setting obstore would otherwise take from the environment given here, so that both
    clients read the same account. Declined for what it cannot honour."""
    from obstore.store import AzureStore

    unknown = sorted(set(options) - _NO_EFFECT - _KNOWN)
    if unknown:
        raise Declined(f"options {', '.join(unknown)}")
    if options.get("credential") is not None or options.get("location_mode", "primary") != "primary":
        raise Declined("a credential object, or a location_mode other than 'primary'")
    if os.environ.get("AZURE_ENCRYPTION_KEY"):
        raise Declined("AZURE_ENCRYPTION_KEY (obstore would send it, adlfs does not)")
    config = _account(options)
    seconds = {name: float(options.get(name) or 300) for name in ("connection_timeout", "read_timeout")}  # azure-core's
    client_options = {"allow_http": config["endpoint"].startswith("http://"),
                      "connect_timeout": datetime.timedelta(seconds=seconds["connection_timeout"]),
                      "read_timeout": datetime.timedelta(seconds=seconds["read_timeout"]),
                      "timeout": datetime.timedelta(days=1)}  # azure-core bounds no whole request
    return AzureStore(container, config={"use_emulator": False, **config}, client_options=client_options,
                      retry_config={"max_retries": 0})  # type: ignore[arg-type]


def _account(options: dict[str, Any]) -> dict[str, Any]:
    """obstore's account, endpoint and credential settings, in adlfs's order: a connection string, else
    an account with its key, a SAS token or anonymous access (options first, then the environment)."""
    env = os.environ.get
    text = options.get("connection_string") or env("AZURE_STORAGE_CONNECTION_STRING")
    if text:
        return _connection_string(text)
    name = options.get("account_name") or env("AZURE_STORAGE_ACCOUNT_NAME")
    if not name:
        raise Declined(f"no account ({_ACCOUNT_HELP})")
    host = options.get("account_host") or f"{name}.blob.core.windows.net"
    where = {"account_name": name, "endpoint": f"https://{host}"}
    key, sas = options.get("account_key") or env("AZURE_STORAGE_ACCOUNT_KEY"), \
        options.get("sas_token") or env("AZURE_STORAGE_SAS_TOKEN")
    anon = options.get("anon")
    anon = anon if anon is not None else env("AZURE_STORAGE_ANON", "false").lower() not in ("false", "0", "f", "")
    if key:
        return {**where, "account_key": key, "credential_type": "access_key"}
    if sas:
        return {**where, "sas_key": sas.removeprefix("?"), "credential_type": "sas_token"}
    if options.get("client_id") or env("AZURE_STORAGE_CLIENT_ID"):
        raise Declined("a service principal (adlfs asks azure-identity for its tokens)")
    if anon:
        return {**where, "skip_signature": True}
    raise Declined("no key, SAS token or anonymous access (adlfs asks azure-identity's DefaultAzureCredential)")


def _connection_string(text: str) -> dict[str, Any]:
    """obstore's settings for a connection string, read as azure-storage-blob reads it."""
    pairs = [part.split("=", 1) for part in text.rstrip(";").split(";")]
    if any(len(pair) != 2 for pair in pairs):
        raise Declined("a malformed connection string (adlfs says)")
    found = {name.upper(): value for name, value in pairs}
    if found.get("USEDEVELOPMENTSTORAGE") == "true":
        found = {"ACCOUNTNAME": EMULATOR_ACCOUNT, "ACCOUNTKEY": EMULATOR_KEY,
                 "BLOBENDPOINT": f"http://127.0.0.1:10000/{EMULATOR_ACCOUNT}"}
    name = found.get("ACCOUNTNAME")
    if not name:
        raise Declined("a connection string without AccountName")
    protocol, suffix = found.get("DEFAULTENDPOINTSPROTOCOL"), found.get("ENDPOINTSUFFIX")
    endpoint = found.get("BLOBENDPOINT") or (f"{protocol}://{name}.blob.{suffix}" if protocol and suffix else
                                             f"https://{name}.blob.{suffix or 'core.windows.net'}")
    where = {"account_name": name, "endpoint": endpoint.rstrip("/")}
    if found.get("ACCOUNTKEY"):
        return {**where, "account_key": found["ACCOUNTKEY"], "credential_type": "access_key"}
    if found.get("SHAREDACCESSSIGNATURE"):
        return {**where, "sas_key": found["SHAREDACCESSSIGNATURE"].removeprefix("?"), "credential_type": "sas_token"}
    return {**where, "skip_signature": True}
