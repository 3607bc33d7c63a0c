"""Save and resume full training state, atomically; load only plain data.

A checkpoint is one file ``checkpoints/epoch-NNNNNN.pt`` written by rank 0 through a
temporary file, fsync and rename: it is complete or absent. It holds the model (no
``module.`` prefix), the optimizer, the number of finished epochs, every rank's RNG
states and the config. Files load with ``weights_only=True``: a checkpoint cannot run code.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import DdpkitError
from ..tree import map_tensors

FORMAT = "ddpkit-checkpoint"
VERSION = 2  # 2: the position in the epoch is kept in samples of the global order (1: in steps)
READABLE_VERSIONS = (1, 2)  # a version-1 position is turned into samples only at its own global batch
CKPT_DIR = "checkpoints"
_NAME = re.compile(r"^epoch-(\d+)(?:-step-(\d+))?\.pt$")


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def save_or_explain(obj: Any, path: Path) -> None:
    """Atomic save; a full disk or unwritable folder becomes a clear error (nothing partial
    is left, and the previous checkpoint stays the one --resume uses)."""
    try:
        atomic_save(obj, path)
    except OSError as e:
        raise DdpkitError(
            f"cannot write {path}: {e.strerror or e}; nothing partial was left and the previous "
            "checkpoint is intact: free space (or fix the folder) and continue with --resume"
        ) from None


class BackgroundWriter:
    """--async-save: one checkpoint write at a time in a thread, so training goes on while the
    file is written. The state handed over must already be a copy on the CPU. The next save,
    the end of the run and any error path wait for it; its error is raised then (the write is
    atomic, so a failed one leaves nothing partial and the previous checkpoint intact).
    Also the writer of the memory snapshots (snapshot.py: `daemon`, a lost write costs nothing)."""

    def __init__(self, name: str = "ddpkit-checkpoint-writer", daemon: bool = False) -> None:
        self.name, self.daemon = name, daemon
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Any) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name=self.name, daemon=self.daemon)
        self._thread.start()

    def _run(self, write: Any) -> None:
        try:
            write()
        except BaseException as e:  # raised in the training thread at the next wait()
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def cpu_copy(obj: Any) -> Any:
    """A copy of a (nested) state with every tensor cloned to the CPU: what a background write
    may hold while training changes the originals."""
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside `folder` durable (the directory entry itself is flushed)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_file(path: str | os.PathLike) -> Any:
    """torch.load with weights_only=True; anything unreadable becomes a DdpkitError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DdpkitError(f"{path}: no such file") from None
    except pickle.UnpicklingError as e:
        raise DdpkitError(f"{path}: refused to load: it is not plain data ({_first_line(e)})") from None
    except Exception as e:  # garbage makes the unpickler fail in many ways (IndexError, EOFError, ...)
        raise DdpkitError(f"{path}: not a readable checkpoint, truncated or corrupt ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def model_signature(state_dict: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in state_dict.items()}


def checkpoint_path(run_dir: str | os.PathLike, epoch: int, step: int = 0) -> Path:
    """epoch-000003.pt: 3 epochs done; epoch-000003-step-000012.pt: and 12 steps of the 4th."""
    return Path(run_dir) / CKPT_DIR / (f"epoch-{epoch:06d}.pt" if not step else f"epoch-{epoch:06d}-step-{step:06d}.pt")


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[tuple[int, int], Path]]:
    """((epoch, step), path) of every checkpoint file in the run, newest first (temporaries ignored)."""
    folder = Path(run_dir) / CKPT_DIR
    if not folder.is_dir():
        return []
    found = [((int(m.group(1)), int(m.group(2) or 0)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def validate_checkpoint(ckpt: Any, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse a checkpoint that is not ddpkit's or does not fit this model/optimizer."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise DdpkitError(f"{path}: not a ddpkit checkpoint (a plain state_dict? load it with torch.load instead)")
    if ckpt.get("version") not in READABLE_VERSIONS:
        raise DdpkitError(
            f"{path}: checkpoint version {ckpt.get('version')} is not supported (this ddpkit writes {VERSION})"
        )
    check_signature(path, model_signature(model.state_dict()), ckpt["model"] and model_signature(ckpt["model"]))
    if optimizer is not None:
        saved_groups = ckpt["optimizer"].get("param_groups", [])
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in optimizer.param_groups]:
            raise DdpkitError(
                f"{path}: checkpoint's optimizer has different parameter groups than this task's optimizer"
            )


def check_signature(path: Path, want: dict[str, list[int]], have: dict[str, list[int]]) -> None:
    """Refuse a checkpoint whose parameter names or shapes differ from the model's."""
    if want != have:
        missing = sorted(set(want) - set(have))[:3]
        extra = sorted(set(have) - set(want))[:3]
        shapes = [f"{k}: {have[k]} vs {want[k]}" for k in want if k in have and have[k] != want[k]][:3]
        detail = "; ".join(
            s
            for s in (
                f"missing {missing}" if missing else "",
                f"unexpected {extra}" if extra else "",
                f"shape mismatch {shapes}" if shapes else "",
            )
            if s
        )
        raise DdpkitError(
            f"{path}: checkpoint is of a different model ({detail}); use another --run-dir or the matching task"
        )
