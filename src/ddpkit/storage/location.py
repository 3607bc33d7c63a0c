"""A run folder's location, local path or URL, and the object store behind a URL.

Why here and nowhere else: `Path("s3://ckpt/x")` is the local folder `s3:/ckpt/x`, so every
place that takes a run folder or checkpoint parses it through `parse()` first and a URL is
never silently turned into a path. Credentials and the endpoint are the backend's own
(AWS_* variables, profiles, instance roles for s3fs): ddpkit neither reads nor keeps them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DdpkitError

SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_COLLAPSED = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/([^/].*)?$")  # what Path() made of "s3://b/p"
# bounded waits: a store that does not answer ends the run in seconds, not at the OS's timeouts
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
ATTEMPTS = 4  # botocore's own retry, with backoff, for throttling (SlowDown, 503) and dropped connections


@dataclass(frozen=True)
class Remote:
    """`scheme://bucket/prefix`: `path` is fsspec's (bucket/prefix, no trailing slash)."""

    scheme: str
    path: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.path}"

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0]

    def join(self, *parts: str) -> str:
        return "/".join([self.path, *(p.strip("/") for p in parts if p)])

    def url_of(self, key: str) -> str:
        return f"{self.scheme}://{key}"


def is_url(text: str | os.PathLike | None) -> bool:
    return text is not None and bool(_URL.match(str(text)))


def parse(text: str | os.PathLike) -> Path | Remote:
    """A local folder (a path or file://) or a Remote (s3://, gs://, az://); anything else that
    looks like a URL, or a path that is a URL with its `//` collapsed, is refused."""
    text = str(text)
    m = _URL.match(text)
    if m is None:
        collapsed = _COLLAPSED.match(text)
        if collapsed and collapsed.group(1).lower() in SCHEMES:
            raise DdpkitError(
                f"{text}: a URL with one slash after '{collapsed.group(1)}:' (a path joined onto a URL?); "
                f"write {collapsed.group(1)}://{collapsed.group(2) or ''}"
            )
        return Path(text)
    scheme, rest = m.group(1).lower(), m.group(2).strip("/")
    if scheme == "file":
        return Path("/" + rest if not rest.startswith("/") else rest)
    if scheme not in SCHEMES:
        raise DdpkitError(
            f"{text}: ddpkit cannot store a run at {scheme}:// URLs; use a local folder, file://, s3://, gs:// or az://"
        )
    if not rest or rest.split("/", 1)[0] in ("", ".", ".."):
        raise DdpkitError(f"{text}: no bucket in the URL; write {scheme}://BUCKET/PREFIX")
    return Remote(scheme, rest)


def filesystem(remote: Remote) -> Any:
    """fsspec's filesystem for the URL's scheme, through the backend's own package, with bounded
    timeouts and retries; a missing package is one line naming the extra that installs it."""
    package = SCHEMES[remote.scheme]
    try:
        import fsspec

        __import__(package)
    except ImportError:
        install = "'ddpkit[s3]'" if package == "s3fs" else f"fsspec {package}"
        raise DdpkitError(
            f"{remote.url}: a run at {remote.scheme}:// needs fsspec and {package}, not installed: "
            f"pip install {install}"
        ) from None
    if package != "s3fs":
        return fsspec.filesystem(remote.scheme, skip_instance_cache=True)
    retries = {  # botocore's own variables, when set, say how often (theirs is the convention)
        "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or ATTEMPTS),
        "mode": os.environ.get("AWS_RETRY_MODE") or "standard",
    }
    config = {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S, "retries": retries}
    fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=config)
    fs.retries = 2  # s3fs's own loop over timeouts, on top of botocore's
    return fs
