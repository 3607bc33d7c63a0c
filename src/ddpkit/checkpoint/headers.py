"""What a run's checkpoints say without a model to load them into: the newest one whose Header
reads and whose files are as written (for `ddpkit runs`), and the newer ones a resume would pass
over. Reading a one-file checkpoint maps its tensors instead of loading them; checking it reads
every byte once (its CRC-32s, integrity.py). Whether it fits a model is resume's question."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import DdpkitError
from . import file as ckpt_file
from .schema import Header


def read_header(path: str | os.PathLike, check: bool = False) -> Header:
    """The Header of a checkpoint file or sharded folder; a DdpkitError when it does not load
    (with `check`: or when any of its files is not as written)."""
    path = Path(path)
    if path.is_dir():
        from .sharded import FORMAT, META, read_complete

        payload, fmt = (read_complete(path) if check else ckpt_file.load_file(path / META)), FORMAT
    else:
        if check:
            ckpt_file.check_file(path)
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # not a zip torch can map (or not loadable at all): load_file says which
            payload = ckpt_file.load_file(path)
        fmt = ckpt_file.FORMAT
    if not isinstance(payload, dict) or payload.get("format") != fmt:
        raise DdpkitError(f"{path}: not a ddpkit checkpoint")
    if payload.get("version") not in ckpt_file.READABLE_VERSIONS:
        raise DdpkitError(f"{path}: checkpoint version {payload.get('version')} is not supported")
    try:
        return Header.read(payload, str(path), None, 0)
    except (KeyError, TypeError, ValueError) as e:
        raise DdpkitError(f"{path}: incomplete header ({type(e).__name__}: {e})") from None


def newest_header(run_dir: str | os.PathLike, check: bool = False) -> tuple[Path, Header] | None:
    """The newest checkpoint of either kind whose header loads, or None; newer ones that do
    not load are passed over, as resume passes them over."""
    return newest_checked(run_dir, check)[0]


def newest_checked(run_dir: str | os.PathLike, check: bool = True) -> tuple[tuple[Path, Header] | None, list[str]]:
    """The newest checkpoint of either kind whose header loads (with `check`: and whose every
    file is as written), and why each newer one was passed over."""
    from .sharded import list_sharded

    candidates = sorted(ckpt_file.list_checkpoints(run_dir) + list_sharded(run_dir), reverse=True)
    passed: list[str] = []
    for _, path in candidates:
        try:
            return (path, read_header(path, check)), passed
        except DdpkitError as e:
            passed.append(str(e))
    return None, passed
