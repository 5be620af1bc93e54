"""The lean ranged client for `s3://`: byte ranges and sizes of objects through obstore (Rust
object_store), ~0.2-0.6 ms of CPU per request where s3fs/aiobotocore spends ~2.5-3 ms.

It takes the same `storage_options` (s3fs's keys) and AWS_* environment as s3fs: credentials,
region and configured endpoints are resolved by botocore as s3fs would (its credential chain, kept
refreshed: temporary credentials are asked for again before they expire). Options it cannot
honour make `client` decline (logged at DEBUG), and the dataset is read through s3fs instead.
obstore's own retries are off: `retry.Retry` is the one retry layer.

A client is made per process and never used in another (`client` keys them by process id). obstore
cannot serve a process forked after it was used (its tokio runtime's threads do not survive the
fork): in such a process `client` declines and s3fs reads. `S3Client`, `made_once` and `translated`
serve other obstore stores alike (`azure.py`, `gcs.py`: the same client over an AzureStore, a GCSStore)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from pipeline.storage.retry import Truncated

__all__ = ["Declined", "S3Client", "S3Error", "client", "made_once", "translated", "unusable"]

log = logging.getLogger("pipeline.storage")
STREAM_CHUNK = 1 << 20  # a streamed download's bytes are handed over (and shown to readers) this many at a time

# s3fs options that change nothing in a ranged read or a HEAD (listing, caching, uploads).
_NO_EFFECT = {"default_block_size", "default_fill_cache", "default_cache_type", "use_listings_cache",
              "listings_expiry_time", "max_paths", "skip_instance_cache", "max_concurrency", "fixed_upload_size",
              "cache_regions", "version_aware", "local_expiry_check"}
_CLIENT_KWARGS = {"endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
                  "verify", "use_ssl"}
_CONFIG_KWARGS = {"read_timeout", "connect_timeout", "region_name", "s3", "signature_version"}
_CREDENTIAL_CODES = {"ExpiredToken", "InvalidToken", "TokenRefreshRequired", "InvalidAccessKeyId",
                     "SignatureDoesNotMatch", "AccessDenied", "RequestTimeTooSkewed", "InvalidSecurity"}
# Object keys every scheme's two clients send alike (others: the fsspec library reads them).
_SAFE_KEY = re.compile(r"[A-Za-z0-9!_.*'()/=+,@-]+")
# obstore asks for credentials again 5 minutes before the expiry it is given: given this much
# earlier, a temporary credential is given up 10 minutes before it expires (botocore's mandatory refresh).
_EARLY = datetime.timedelta(minutes=5)


class S3Error(Exception):
    """An error answer of an S3 server: its HTTP status, S3 error code and message."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(status, code, message)
        self.status, self.code, self.message = status, code, message

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}" if self.code else f"{self.status} {self.message}"


class S3Client:
    """Ranged reads and sizes of one bucket's objects, with fsspec's method names (`cat_file`,
    `size`), so that `fs.read_range` drives it as it drives a filesystem. One request per call. Each
    answer says the object's size (`seen_size`): readers check it against the manifest's without
    asking for it apart (a HEAD per shard and process, half the requests of a cold cache's epoch)."""

    scheme, error = "s3", S3Error  # (another service's lean client: its scheme, and the class of its error answers)

    def __init__(self, store: Any, bucket: str) -> None:
        self.store, self.bucket, self.pid = store, bucket, os.getpid()
        self.sizes: dict[str, int] = {}  # object key -> its size, as the last answer about it said

    def cat_file(self, path: str, start: int, end: int) -> Any:
        """Bytes [start, end) (a buffer of them); an S3Error 416 where the object ends before `end`."""
        import obstore

        self._check()
        try:
            result = obstore.get(self.store, path, options={"range": (start, end)})
            size = self.sizes[path] = int(result.meta["size"])  # (from the answer's Content-Range: no HEAD needed)
            data = result.bytes()
        except Exception as exc:
            self._raise(exc, path)
        if size < end:  # (not worth trying again)
            raise self.error(416, "InvalidRange", f"the object is {size} bytes, ending before byte {end}")
        return data

    def seen_size(self, path: str) -> int | None:
        """The object's size as the last answer about it said (every ranged GET carries it), or None."""
        return self.sizes.get(path)

    def stream(self, path: str, start: int, end: int) -> Iterator[memoryview]:
        """Bytes [start, end) by one request, as they arrive (pieces of `STREAM_CHUNK` bytes or more, but the last)."""
        import obstore

        self._check()
        try:
            result = obstore.get(self.store, path, options={"range": (start, end)})
            size = self.sizes[path] = int(result.meta["size"])
        except Exception as exc:
            self._raise(exc, path)
        if size < end:
            raise self.error(416, "InvalidRange", f"the object is {size} bytes, ending before byte {end}")
        try:
            for piece in result.stream(min_chunk_size=STREAM_CHUNK):
                yield memoryview(piece)
        except Exception as exc:
            self._raise(exc, path)

    def size(self, path: str) -> int:
        import obstore

        self._check()
        try:
            size = self.sizes[path] = int(obstore.head(self.store, path)["size"])
            return size
        except Exception as exc:
            self._raise(exc, path)

    def _raise(self, exc: Exception, path: str) -> NoReturn:
        error = translated(exc, f"{self.scheme}://{self.bucket}/{path}", self.error)
        if error is exc:
            raise exc
        raise error from exc

    def _check(self) -> None:
        if self.pid != os.getpid():  # (it would wait forever on the parent's runtime)
            raise RuntimeError(f"{self.scheme}:// client made in process {self.pid} used in process {os.getpid()}: "
                               "clients are not fork-safe; make one in the process that reads")


def client(url: str, storage_options: dict[str, Any] | None) -> tuple[S3Client, str] | None:
    """The lean client of an `s3://` URL's bucket and the object's key in it, made once per process,
    options and AWS_* environment; None where it cannot read as s3fs would (the reason logged at
    DEBUG): then s3fs reads."""
    bucket, _, key = url.partition("://")[2].partition("/")
    return made_once(url, storage_options, ("AWS_", "s3fs"), _unusable(bucket, key),
                     lambda options: S3Client(_store(bucket, options), bucket))


def made_once(url: str, storage_options: dict[str, Any] | None, env_and_fallback: tuple[str | tuple[str, ...], str],
              reason: str | None, make: Callable[[dict[str, Any]], S3Client]) -> tuple[S3Client, str] | None:
    """A scheme's lean client of the URL's bucket (or container) and the object's key in it: `make(options)`,
    called once per process, bucket, options and environment (the variables whose names start with the
    prefix, which the scheme's libraries read). None where `reason` says why the lean client cannot
    serve, `make` declines (`Declined`), or obstore cannot run in this process: then the fallback
    (fsspec's filesystem, named in the logs) reads."""
    prefix, fallback = env_and_fallback
    bucket, _, key = url.partition("://")[2].partition("/")
    where = f"{url.partition('://')[0]}://{bucket}"
    options = dict(storage_options or {})
    env = sorted((name, value) for name, value in os.environ.items() if name.startswith(prefix))
    cache_key = (os.getpid(), where, json.dumps([options, env], sort_keys=True, default=repr))
    reason = reason or _runtime_refusal(where, fallback)
    found = _CLIENTS.get(cache_key)
    if reason is None and found is None:
        try:
            with _LOCK:
                found = _CLIENTS.get(cache_key)
                if found is None:
                    found = _CLIENTS[cache_key] = make(options)
                    _RUNTIME[:] = _RUNTIME or [os.getpid()]
                    log.debug("%s: lean client made in process %d", where, os.getpid())
        except Declined as exc:
            reason = str(exc)
        except Exception as exc:  # (credentials botocore cannot get, a CA bundle obstore cannot parse: s3fs says)
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("%s: cannot make the lean client (%s); reading through %s", url, reason, fallback)
    if reason is not None or found is None:
        log.debug("%s: read through %s, not the lean client: %s", url, fallback, reason)
        return None
    return found, key


_CLIENTS: dict[tuple[int, str, str], S3Client] = {}  # by process, bucket, options and environment
_LOCK = threading.Lock()
_RUNTIME: list[int] = []  # the process that first made a store in this memory image (obstore's runtime there),
# then a forked process that was told it cannot use it


class Declined(Exception):
    """Options or an environment a lean client cannot honour (the message says which)."""


def _unusable(bucket: str, key: str) -> str | None:
    where = None if bucket and not bucket.endswith("--x-s3") else f"bucket {bucket!r} (S3 Express or none)"
    return unusable(where, key, ("key", "s3fs"),
                    "install the package's s3 extra, or pip install 's3fs>=2023.1' 'obstore>=0.12,<0.13'")


def unusable(where: str | None, key: str, names: tuple[str, str], extra: str) -> str | None:
    """Why a scheme's lean client cannot read an object, or None: obstore missing (`extra` installs
    it), the scheme's own objection to the bucket or container (`where`), or a key with characters
    only the scheme's fsspec library sends as they are (`names`: what the scheme calls a key, and
    that library)."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        return f"obstore is not installed ({extra})"
    if where is not None:
        return where
    if not _SAFE_KEY.fullmatch(key) or "//" in key:
        return f"{names[0]} {key!r} has characters sent as they are only by {names[1]}"
    return None


def _runtime_refusal(where: str, fallback: str) -> str | None:
    """Why obstore cannot run in this process (forked after it ran in its parent), said once per process; else None."""
    if _RUNTIME and _RUNTIME[0] != os.getpid():
        reason = (f"obstore ran in process {_RUNTIME[0]} before it forked this one, and cannot run here (use the "
                  "'spawn' or 'forkserver' multiprocessing context, or read no shard from object storage before "
                  "forking workers)")
        if _RUNTIME[-1] != os.getpid():  # (said once per process)
            _RUNTIME.append(os.getpid())
            log.warning("%s: read through %s (~5x the CPU per request): %s", where, fallback, reason)
        return reason
    return None


def _store(bucket: str, options: dict[str, Any]) -> Any:
    """An obstore S3Store for the bucket, configured from s3fs's options and botocore's view of the
    AWS_* environment and config files; raises Declined for what it cannot honour."""
    from obstore.store import S3Store

    client_kwargs, config_kwargs = dict(options.get("client_kwargs") or {}), dict(options.get("config_kwargs") or {})
    _refuse_unknown(options, client_kwargs, config_kwargs)
    session = _session(options.get("profile"))
    where = _where(bucket, options, client_kwargs, config_kwargs, session)
    signing, provider = _credentials(options, client_kwargs, config_kwargs, session)
    config = {"bucket": bucket, "request_payer": bool(options.get("requester_pays")), "skip_signature": False,
              "s3_express": False, **where, **signing}
    client_options = _client_options(where["endpoint"], client_kwargs, config_kwargs, session)
    no_retries = {"max_retries": 0}  # (retry.Retry is the one retry layer)
    return S3Store(config=config, client_options=client_options, retry_config=no_retries,  # type: ignore[arg-type]
                   credential_provider=provider)


def _refuse_unknown(options: dict[str, Any], client_kwargs: dict[str, Any], config_kwargs: dict[str, Any]) -> None:
    """Declined for an s3fs option, client or config keyword the lean client does not honour."""
    unknown = sorted(set(options) - _NO_EFFECT - {"key", "secret", "token", "username", "password", "anon",
                                                  "endpoint_url", "client_kwargs", "config_kwargs", "profile",
                                                  "requester_pays", "use_ssl"})
    unknown += [f"client_kwargs[{k!r}]" for k in sorted(set(client_kwargs) - _CLIENT_KWARGS)]
    unknown += [f"config_kwargs[{k!r}]" for k in sorted(set(config_kwargs) - _CONFIG_KWARGS)]
    s3_config = dict(config_kwargs.get("s3") or {})
    unknown += [f"config_kwargs['s3'][{k!r}]" for k in sorted(set(s3_config) - {"addressing_style"})]
    if unknown:
        raise Declined(f"options {', '.join(unknown)}")


def _where(bucket: str, options: dict[str, Any], client_kwargs: dict[str, Any], config_kwargs: dict[str, Any],
           session: Any) -> dict[str, Any]:
    """The store's endpoint, region and addressing, as botocore would pick them (Declined where the
    lean client would not reach the same place)."""
    scoped = session.get_scoped_config()
    for name in ("use_fips_endpoint", "use_dualstack_endpoint"):
        if session.get_config_variable(name) not in (None, False, "false"):
            raise Declined(f"botocore setting {name!r} (AWS_* environment or config file)")
    for name in sorted(set(scoped.get("s3") or {}) - {"addressing_style"}):
        raise Declined(f"config file setting s3.{name}")
    if os.environ.get("AWS_SSE_CUSTOMER_KEY_BASE64"):
        raise Declined("AWS_SSE_CUSTOMER_KEY_BASE64 (obstore would send it, botocore does not)")
    endpoint = _one(options, client_kwargs, "endpoint_url", "endpoint_url")
    if endpoint is None and not session.get_config_variable("ignore_configured_endpoint_urls"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint is None and ("endpoint_url" in scoped or "services" in scoped):
            raise Declined("an endpoint set in the AWS config file")
    region = client_kwargs.get("region_name") or config_kwargs.get("region_name") or \
        session.get_config_variable("region")
    styles = [(settings.get("s3") or {}).get("addressing_style") for settings in (config_kwargs, scoped)]
    style = next((s for s in styles if s), "auto")
    if endpoint is not None:
        if style == "virtual":
            raise Declined("virtual-hosted addressing on a custom endpoint")
        return {"endpoint": endpoint.rstrip("/"), "region": region or "us-east-1",
                "virtual_hosted_style_request": False}
    if region is None:
        raise Declined("no region (s3fs follows the bucket's redirect)")
    if options.get("use_ssl") is False or client_kwargs.get("use_ssl") is False:
        raise Declined("use_ssl=False")
    virtual = style != "path" and re.fullmatch(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]", bucket) is not None
    host = f"{bucket}.s3.{region}.amazonaws.com" if virtual else f"s3.{region}.amazonaws.com"
    return {"endpoint": f"https://{host}", "region": region, "virtual_hosted_style_request": virtual}


def _credentials(options: dict[str, Any], client_kwargs: dict[str, Any], config_kwargs: dict[str, Any],
                 session: Any) -> tuple[dict[str, Any], _Credentials | None]:
    """(the store's signing settings, a credential provider or None): anonymous, the options' keys,
    or botocore's credential chain."""
    key = _one(options, client_kwargs, "key", "aws_access_key_id") or options.get("username")
    secret = _one(options, client_kwargs, "secret", "aws_secret_access_key") or options.get("password")
    token = _one(options, client_kwargs, "token", "aws_session_token")
    signature = config_kwargs.get("signature_version")
    if options.get("anon") or type(signature).__name__ == "UNSIGNED":  # (botocore.UNSIGNED)
        return {"skip_signature": True}, None
    if signature not in (None, "s3v4", "v4"):
        raise Declined(f"signature_version {signature!r}")
    if key is not None or secret is not None:
        if key is None or secret is None:
            raise Declined("a key without a secret, or a secret without a key")
        return {"access_key_id": key, "secret_access_key": secret,
                **({"session_token": token} if token is not None else {})}, None
    credentials = session.get_credentials()
    if credentials is None:
        raise Declined("no credentials found by botocore")
    return {}, _Credentials(credentials)


def _client_options(endpoint: str, client_kwargs: dict[str, Any], config_kwargs: dict[str, Any],
                    session: Any) -> dict[str, Any]:
    """obstore's HTTP client options: botocore's timeouts and certificate settings."""
    seconds = {name: float(config_kwargs.get(name, 60)) for name in ("connect_timeout", "read_timeout")}  # botocore's
    found: dict[str, Any] = {"allow_http": endpoint.startswith("http://"),
                             "connect_timeout": datetime.timedelta(seconds=seconds["connect_timeout"]),
                             "read_timeout": datetime.timedelta(seconds=seconds["read_timeout"]),
                             "timeout": datetime.timedelta(days=1)}  # botocore bounds no whole request
    verify = client_kwargs.get("verify", session.get_config_variable("ca_bundle"))
    if verify is False:
        found["allow_invalid_certificates"] = True
    elif isinstance(verify, str) and endpoint.startswith("https://"):
        try:
            with open(verify, "rb") as f:  # (added to the system's roots; botocore trusts the bundle alone)
                found["root_certificate"] = f.read()
        except OSError as exc:
            raise Declined(f"CA bundle {verify!r}: {exc}") from exc
    return found


def _one(options: dict[str, Any], client_kwargs: dict[str, Any], name: str, boto_name: str) -> Any:
    """An s3fs option given at the top or in client_kwargs (botocore's name); both, different: declined."""
    top, inner = options.get(name), client_kwargs.get(boto_name)
    if top is not None and inner is not None and top != inner:
        raise Declined(f"{name!r} and client_kwargs[{boto_name!r}] differ")
    return top if top is not None else inner


def _session(profile: str | None) -> Any:
    """A botocore session (it resolves credentials, region and settings from the AWS_* environment
    and config files, as for s3fs); a missing profile is declined (s3fs names it)."""
    import botocore.exceptions
    import botocore.session

    try:
        session = botocore.session.Session(profile=profile)
        session.get_scoped_config()
    except botocore.exceptions.BotoCoreError as exc:
        raise Declined(f"botocore: {exc}") from exc
    return session


class _Credentials:
    """obstore's credential provider over botocore's credentials: temporary ones (credential_process,
    SSO, assumed roles, web identity, container and instance credentials) are asked for again 10
    minutes before they expire, and botocore refreshes them."""

    def __init__(self, credentials: Any) -> None:
        self.credentials = credentials

    def __call__(self) -> dict[str, Any]:
        frozen = self.credentials.get_frozen_credentials()
        expiry = getattr(self.credentials, "_expiry_time", None)  # (RefreshableCredentials'; None: static)
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": None if expiry is None else (expiry - _EARLY).astimezone(datetime.timezone.utc)}


def translated(exc: Exception, url: str, error: type[S3Error] = S3Error) -> Exception:
    """obstore's error as what `retry.transient` and the reader's messages understand: a missing object
    as FileNotFoundError, refused credentials as PermissionError, other answers as `error` (status,
    code: S3's, or another service's answers of the same XML shape), a timeout as TimeoutError, other
    transport failures as ConnectionError; one line each."""
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(f"{url}: no such object")
    text = re.sub(r"^Generic \w+ error: ", "", str(exc).split("\n\nDebug source:")[0])
    status = re.search(r"status code: (\d{3})(?: ([^:]*))?", text)
    code = re.search(r"<Code>(.*?)</Code>", text)
    message = re.search(r"<Message>(.*?)</Message>", text)
    if status is not None:
        answer = error(int(status.group(1)), code.group(1) if code else None,
                       message.group(1) if message else (status.group(2) or "").strip() or text)
        if answer.status in (401, 403) or answer.code in _CREDENTIAL_CODES:
            return PermissionError(str(answer))
        return answer
    if type(exc).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
        return PermissionError(text)
    if type(exc).__name__ != "GenericError" or "HTTP error" not in text:
        return exc
    debug = str(exc)
    if "IncompleteBody" in debug or "UnexpectedEof" in debug:
        return Truncated(f"the response body was cut short ({text})")
    kind = re.search(r"kind: (\w+)", debug)
    return TimeoutError(text) if kind and kind.group(1) == "Timeout" else ConnectionError(text)
