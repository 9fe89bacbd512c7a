"""The object store's endpoint and the settings no request can succeed without, checked
before the first request so that a configuration error is reported at once, saying what to
set, instead of being retried for ``DCP_STORAGE_TOTAL_TIMEOUT``."""

from __future__ import annotations

import logging
import os
import socket

from .._errors import StorageConfigError

logger = logging.getLogger(__name__)


def endpoint_of(scheme: str) -> str:
    """The endpoint requests go to, for messages."""
    if scheme.startswith("s3"):
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or \
            f"https://s3.{region}.amazonaws.com"
    return {"gs": "https://storage.googleapis.com", "gcs": "https://storage.googleapis.com"}.get(
        scheme, "the Azure blob endpoint of the account")


def endpoint_source(scheme: str) -> str:
    """How the endpoint was chosen, for messages."""
    if not scheme.startswith("s3"):
        return "the store's public endpoint"
    if os.environ.get("AWS_ENDPOINT_URL_S3"):
        return "AWS_ENDPOINT_URL_S3"
    if os.environ.get("AWS_ENDPOINT_URL"):
        return "AWS_ENDPOINT_URL"
    return ("AWS_ENDPOINT_URL is unset, so requests go to AWS S3 in region "
            f"{os.environ.get('AWS_REGION') or os.environ.get('AWS_DEFAULT_REGION') or 'us-east-1'} (AWS_REGION)")


def check_settings(scheme: str, root: str) -> None:
    """StorageConfigError for settings no request can succeed with: obstore refuses a
    plain-http endpoint unless allowed, and reports it per request as a retryable
    "builder error" (118 attempts over 300 s before this check)."""
    endpoint = endpoint_of(scheme)
    if endpoint.lower().startswith("http:") and os.environ.get("AWS_ALLOW_HTTP", "").lower() != "true":
        raise StorageConfigError(
            f"the endpoint {endpoint} ({endpoint_source(scheme)}) is plain http, which the object-store "
            "client refuses unless it is allowed: set AWS_ALLOW_HTTP=true for an http:// endpoint (a local "
            "or test server such as MinIO or moto), or give its https:// address", path=root)


#: Endpoints this process connected to once (``reach``): each is probed only on first use.
_REACHED: set[str] = set()
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def reach(scheme: str, root: str, timeout: float) -> None:
    """Before the first request to an endpoint: one TCP connection to it, bounded by
    ``timeout`` (10 s), so that an endpoint that cannot be reached at all (no network, a
    wrong host or port) is a StorageConfigError naming it and how it was chosen, at once,
    instead of ~300 s of silent retries. Skipped behind a proxy (requests go through it)."""
    from urllib.parse import urlsplit

    endpoint = endpoint_of(scheme)
    if endpoint in _REACHED or any(os.environ.get(v) for v in _PROXY_VARS):
        return
    url = urlsplit(endpoint)
    if not url.hostname:
        return  # an endpoint known only to the client (Azure): nothing to probe
    port = url.port or (80 if url.scheme == "http" else 443)
    logger.debug("connecting to %s (%s)", endpoint, endpoint_source(scheme))
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise StorageConfigError(
            f"cannot reach the object store at {endpoint} ({endpoint_source(scheme)}): "
            f"{type(e).__name__}: {e} (one connection tried for up to {timeout:g} s). Check the network, "
            "or set AWS_ENDPOINT_URL to the store's address (and AWS_ALLOW_HTTP=true for http://)",
            path=root) from None
    _REACHED.add(endpoint)
