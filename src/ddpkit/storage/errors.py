"""An object store's failure as one line: the URL, what went wrong, what to check.

Why one place: s3fs, botocore and aiohttp raise a dozen kinds of exception for the same few
causes (unreachable, no such bucket, access denied, throttled, out of quota); a user needs the
cause and the URL, never the stack. No message carries a credential: only the URL and the
endpoint (AWS_ENDPOINT_URL, which is an address, not a secret).
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Iterator

from ..errors import DdpkitError
from .location import ATTEMPTS, Remote

# how stores say they are full: MinIO's XMinioStorageFull (507), Ceph's QuotaExceeded (403)
_FULL = ("quota", "storagefull", "insufficient storage")
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ClientConnectorError")


class StoreError(DdpkitError):
    """The object store refused or failed an operation (the message says which and why)."""


def why(remote: Remote, e: BaseException, doing: str) -> str:
    """The one line for `e`, raised while `doing` (uploading X, listing, ...) under `remote`."""
    text = " ".join(str(e).split())[:240]
    lower = text.lower()
    names = {t.__name__ for t in type(e).__mro__}
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
    where = f" (endpoint {endpoint})" if endpoint and remote.scheme == "s3" else ""
    if names & set(_UNREACHABLE) or isinstance(e, (ConnectionError, TimeoutError)):
        return (
            f"cannot reach the object store for {remote.url}{where} while {doing}: {text}; check the network "
            "and the endpoint (AWS_ENDPOINT_URL for S3-compatible servers)"
        )
    if "bucket does not exist" in lower or "nosuchbucket" in lower:
        return f"{remote.url}: no such bucket '{remote.bucket}'{where}; create it, or fix the URL"
    if getattr(e, "errno", None) == errno.ENOSPC or any(w in lower for w in _FULL):  # before 403: Ceph's quota is one
        return f"{remote.url}: the bucket is full (its quota) while {doing}: {text}; free space or raise the quota"
    if isinstance(e, PermissionError) or "access denied" in lower or "forbidden" in lower or "403" in lower:
        return (
            f"{remote.url}: access denied while {doing}{where}; check the credentials the backend finds "
            "(AWS_ACCESS_KEY_ID/AWS_PROFILE, an instance role) and the bucket's policy"
        )
    if "slowdown" in lower or "throttl" in lower or "503" in lower or "toomanyrequests" in lower:
        return (
            f"{remote.url}: the object store kept throttling ddpkit while {doing} ({ATTEMPTS} attempts with "
            "backoff); save less often (--save-every-steps) or raise the bucket's request limit"
        )
    return f"{remote.url}: the object store failed while {doing}: {type(e).__name__}: {text}"


@contextlib.contextmanager
def explained(remote: Remote, doing: str) -> Iterator[None]:
    """Any failure of the store inside becomes one StoreError line (a DdpkitError passes as it is)."""
    try:
        yield
    except DdpkitError:
        raise
    except Exception as e:  # botocore, aiohttp and fsspec raise many kinds for the same causes
        raise StoreError(why(remote, e, doing)) from None
