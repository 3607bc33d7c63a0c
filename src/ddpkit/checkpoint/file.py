"""Save and resume full training state, atomically; load only plain data.

A checkpoint is one file ``checkpoints/epoch-NNNNNN.pt`` written by rank 0 through a
temporary file, fsync and rename: it is complete or absent. It holds the model (no
``module.`` prefix), the optimizer, the number of finished epochs, every rank's RNG
states and the config. Files load with ``weights_only=True``: a checkpoint cannot run code;
and only once every record matches the CRC-32 written with it: a damaged one is never trained from.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import DdpkitError
from ..util.tree import map_tensors
from .integrity import WriteThrough, is_torch_zip, verify_zip

FORMAT = "ddpkit-checkpoint"
VERSION = 2  # 2: the position in the epoch is kept in samples of the global order (1: in steps)
READABLE_VERSIONS = (1, 2)  # a version-1 position is turned into samples only at its own global batch
CKPT_DIR = "checkpoints"
_NAME = re.compile(r"^epoch-(\d+)(?:-step-(\d+))?\.pt$")
TMP_SUFFIX = ".tmp"  # atomic_save's temporary file: `.NAME.RANDOM.tmp` beside NAME


def atomic_save(obj: Any, path: str | os.PathLike, private: bool = False) -> Path:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`.
    Every record carries its CRC-32 (torch's zip format; load_file checks them). `private`: the
    file is 0600 (what another local user must not read), else as open() would create it."""
    return atomic_write(path, lambda sink: torch.save(obj, sink), private)


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[Any], None],
    private: bool = False,
    drain: Callable[[], None] | None = None,
) -> Path:
    """`write(sink)` (torch's zip format, CRC-32 on) into a temporary file in the same folder,
    fsync, then rename over `path`; on a failure the temporary file goes, then `drain()` runs
    (what the write left that other ranks wait for), then the error is raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    if not private:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
    try:
        with os.fdopen(fd, "wb") as f, _crc32_on():
            sink = WriteThrough(f)
            try:
                write(sink)
            except RuntimeError:
                if sink.error is not None:  # torch's `unexpected pos`: the write's own error says why
                    raise sink.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if drain is not None:
            drain()
        raise
    return path


@contextlib.contextmanager
def _crc32_on() -> Iterator[None]:
    """torch.save writes each record's CRC-32 unless told not to; a checkpoint always has them."""
    from torch.serialization import get_crc32_options, set_crc32_options

    if get_crc32_options():
        yield
        return
    set_crc32_options(True)
    try:
        yield
    finally:
        set_crc32_options(False)


def save_or_explain(obj: Any, path: Path) -> None:
    """Atomic save; a full disk or unwritable folder becomes a clear error (nothing partial
    is left, and the previous checkpoint stays the one --resume uses)."""
    with explained(path):
        atomic_save(obj, path)


@contextlib.contextmanager
def explained(path: Path) -> Iterator[None]:
    """An atomic write to `path` whose OSError (a full disk, an unwritable folder) becomes one
    clear error."""
    try:
        yield
    except OSError as e:
        raise DdpkitError(
            f"cannot write {path}: {e.strerror or e}; nothing partial was left and the previous "
            "checkpoint is intact: free space (or fix the folder) and continue with --resume"
        ) from None


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """What a killed save left in the run's checkpoints folder (a `.NAME.*.tmp` file, a
    `.NAME.partial` or `.NAME.old` folder): never read, only taking space. Rank 0, at the start
    of a run, before any save of its own can be in flight."""
    folder = Path(run_dir) / CKPT_DIR
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    gone = []
    for entry in entries:
        name = entry.name
        if not name.startswith("."):
            continue
        if name.endswith(TMP_SUFFIX) and entry.is_file():
            entry.unlink(missing_ok=True)
        elif name.endswith((".partial", ".old")) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            continue
        gone.append(entry)
    return gone


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


def replace_folder(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Put the finished folder `src` in place as `dst`, atomically for a reader: an existing `dst`
    is renamed aside (`.NAME.old`) and removed only once `src` is in place: a reader finds the old
    folder, the new one or none (a crash between the two renames), never a mix of them.
    The one writer of folders here: sharded checkpoints, exports, a run's hf_config/."""
    src, dst = Path(src), Path(dst)
    old = dst.parent / f".{dst.name}.old"
    if dst.exists():  # the same folder written again (a resumed run, a re-export): swap, then drop the old one
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    shutil.rmtree(old, ignore_errors=True)


def load_file(path: str | os.PathLike) -> Any:
    """torch.load with weights_only=True, after every record of the file is checked against its
    CRC-32 (integrity.py); anything unreadable or damaged becomes a DdpkitError naming the file."""
    check_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DdpkitError(f"{path}: no such file") from None
    except pickle.UnpicklingError as e:
        if not is_torch_zip(path):
            raise DdpkitError(f"{path}: not a torch checkpoint file (random bytes, or another format)") from None
        raise DdpkitError(f"{path}: refused to load: {not_plain_data(e)}") from None
    except Exception as e:  # garbage makes the unpickler fail in many ways (IndexError, EOFError, ...)
        raise DdpkitError(f"{path}: not a readable checkpoint, truncated or corrupt ({_first_line(e)})") from None


def check_file(path: str | os.PathLike) -> None:
    """A file that exists and, in torch's zip format, whose every record matches its CRC-32."""
    if not os.path.isfile(path):
        raise DdpkitError(f"{path}: no such file")
    if is_torch_zip(path):
        verify_zip(path)


def not_plain_data(e: BaseException) -> str:
    """What torch's weights_only unpickler refused (the global it names), without its advice to
    load the file unrestricted or to allow-list that global: either is how a crafted file runs its
    code. The one wording of that refusal for every file ddpkit loads as plain data."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    advice = ("weights_only", "Re-running", "Weights only load failed", "Check the documentation", "(1)", "(2)")
    why = [line for line in lines if not any(word in line for word in advice)]
    why = [line.split(" Please use ")[0].split(" was not an allowed global")[0] for line in why]
    detail = f" ({why[0][:200]})" if why else ""
    return f"it is not plain data{detail}: a file crafted to run code, or one saved with objects"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def model_signature(state_dict: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in state_dict.items()}


def signature_of(model: torch.nn.Module) -> dict[str, list[int]]:
    """The names and shapes a checkpoint of `model` is of: the whole model's where this rank
    holds a part of its layers (a pipeline stage's `whole_signature`), else its own."""
    whole = getattr(model, "whole_signature", None)
    return whole if whole is not None else model_signature(model.state_dict())


def groups_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    """The optimizer's parameter groups' sizes, the whole model's (a pipeline stage's `whole_groups`)."""
    whole = getattr(model, "whole_groups", None)
    return whole if whole is not None else [len(g["params"]) for g in optimizer.param_groups]


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
    check_signature(path, signature_of(model), ckpt["model"] and model_signature(ckpt["model"]))
    if not all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point()):
        raise DdpkitError(  # a save refuses NaN/inf weights: the file was changed, its CRC-32s rewritten with it
            f"{path}: its weights hold NaN/inf, which ddpkit never saves: changed after it was written"
        )
    if optimizer is not None:
        saved_groups = ckpt["optimizer"].get("param_groups", [])
        if [len(g["params"]) for g in saved_groups] != groups_of(model, optimizer):
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
