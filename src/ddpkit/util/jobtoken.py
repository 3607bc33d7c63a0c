"""The job token: a secret every node of a multi-node job holds, so that the job's stores serve
only its own nodes (runtime/sealed.py). torch's TCPStore has no authentication and lists its
keys to anyone who connects, so the token is not a password the store checks: every key and
value is sealed with keys derived from it, and whoever lacks it can neither read, forge nor be
counted (README, Security, says what it does not protect).

Where it comes from, and why not a flag: DDPKIT_JOB_TOKEN_FILE (a file only its owner may read,
what `ddpkit slurm` writes) or DDPKIT_JOB_TOKEN (the token itself, what a Kubernetes Secret or
an engine's secret environment sets). A command-line value would be in `ps` for every user of
the node. The token is never printed, logged or written by ddpkit anywhere but that file.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path
from typing import Mapping

from ..errors import DdpkitError

TOKEN_VAR = "DDPKIT_JOB_TOKEN"
TOKEN_FILE_VAR = "DDPKIT_JOB_TOKEN_FILE"
TOKEN_FILE_NAME = "job-token"  # `ddpkit slurm`: in the run directory, mode 0600
MIN_CHARS = 16
# the derived key is what seals; a slow derivation makes guessing a weak token from what the
# store shows (a sealed value checks a guess) cost ~0.1 s a guess instead of a microsecond
_ROUNDS = 100_000


def job_token() -> bytes | None:
    """This job's secret key (derived from the token), or None when no token is set."""
    text = _token_text()
    if text is None:
        return None
    if len(text) < MIN_CHARS:
        raise DdpkitError(
            f"the job token ({_where()}) has {len(text)} characters: use at least {MIN_CHARS} random ones, "
            'e.g. python -c "import secrets; print(secrets.token_urlsafe(32))"'
        )
    return _derived(text)


def has_job_token(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a token is set in `environ` (this process's environment by default), without reading it."""
    e = os.environ if environ is None else environ
    return bool(e.get(TOKEN_FILE_VAR) or e.get(TOKEN_VAR, "").strip())


def token_source() -> str | None:
    """Where the token is read from, for the plan (never the token)."""
    if os.environ.get(TOKEN_FILE_VAR):
        return f"from {TOKEN_FILE_VAR} ({os.environ[TOKEN_FILE_VAR]})"
    return f"from {TOKEN_VAR}" if has_job_token() else None


def _derived(text: str) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", text.encode(), b"ddpkit job token", _ROUNDS)


def _token_text() -> str | None:
    path = os.environ.get(TOKEN_FILE_VAR)
    if path:
        return read_token_file(Path(path))
    text = os.environ.get(TOKEN_VAR, "").strip()
    return text or None


def _where() -> str:
    return f"{TOKEN_FILE_VAR}={os.environ[TOKEN_FILE_VAR]}" if os.environ.get(TOKEN_FILE_VAR) else TOKEN_VAR


def read_token_file(path: Path) -> str:
    """The token in `path`, refused (as ssh refuses a key) when others may read the file."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read(4096).decode("utf-8", "replace").strip()
    except OSError as e:
        raise DdpkitError(f"{TOKEN_FILE_VAR}: cannot read the job token file {path} ({e.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise DdpkitError(
            f"the job token file {path} may be read by others (mode {stat.S_IMODE(mode):04o}): chmod 600 {path}"
        )
    if not text:
        raise DdpkitError(f"the job token file {path} is empty")
    return text


def ensure_token_file(folder: Path) -> Path:
    """FOLDER/job-token: made with a new random token (mode 0600 from its creation, never wider),
    or kept when there already is one (a resubmitted job keeps its token)."""
    path = folder / TOKEN_FILE_NAME
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        read_token_file(path)  # refused when others may read it
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path
