"""Sharded checkpoints (FSDP, HSDP, --tp, --pp): every rank writes its own part, with torch.distributed.checkpoint.

A sharded checkpoint is the directory ``checkpoints/epoch-NNNNNN/`` (or
``epoch-NNNNNN-step-MMMMMM/`` after a stop between steps): DCP's ``.metadata``, one
``__R_0.distcp`` file per rank (model and optimizer shards), and ``ddpkit.pt`` (the
checkpointer's Header: position, parts, every rank's RNG states, config, the model's
signature, and the size and CRC-32 of every other file, integrity.py), written by rank 0. Read
back only once every file is as written, and `.metadata` and the shards' items as plain data
(dcp_io.py).

Atomic as a whole: all ranks write into ``checkpoints/.epoch-NNNNNN.partial/`` (files
fsynced); DCP writes ``.metadata`` on rank 0 only once every rank's shard is on disk; then
rank 0 adds ``ddpkit.pt`` and renames the directory into place. A crash mid-save leaves a
``.partial`` directory that resume never reads (and the next save of that epoch removes).

Loading reshards: DCP reads each rank's part of every tensor from whichever files hold it,
so a checkpoint written by 4 ranks loads on 2, or whole into a DDP run. Every tensor is named as in
the whole model (a tp slice of its Linear, a pipeline stage's blocks), so any mesh reads any other's. The run directory
must be one file system every rank sees (on several nodes: a shared one).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..errors import DdpkitError
from ..runtime import Runtime
from . import dcp_io
from . import file as ckpt_io
from .dcp_io import ChecksumWriter, check_items, folder_metadata, load_into
from .integrity import DamagedCheckpoint, verify_files
from .schema import Header
from .state import unwrap, whole_param_groups

FORMAT = "ddpkit-sharded-checkpoint"
STATE_VERSION = 1  # rt.save(..., sharded=True) folders (training checkpoints carry checkpoint.file.VERSION)
META = "ddpkit.pt"
FILES = "files"  # in ddpkit.pt: {file name: (size, CRC-32)} of every other file of the folder
LAYOUT = "layout"  # in ddpkit.pt: 2, every file of the folder is in FILES; absent in folders written before
LAYOUT_VERSION = 2
_NAME = re.compile(r"^epoch-(\d+)(?:-step-(\d+))?$")


def checkpoint_dir(run_dir: str | os.PathLike, epoch: int, step: int = 0) -> Path:
    """The directory of a sharded checkpoint: named as checkpoint.checkpoint_path, without .pt."""
    return ckpt_io.checkpoint_path(run_dir, epoch, step).with_suffix("")


def list_sharded(run_dir: str | os.PathLike) -> list[tuple[tuple[int, int], Path]]:
    """((epoch, step), path) of every sharded checkpoint directory, newest first (.partial ones ignored)."""
    folder = Path(run_dir) / ckpt_io.CKPT_DIR
    if not folder.is_dir():
        return []
    found = [
        ((int(m.group(1)), int(m.group(2) or 0)), p)
        for p in folder.iterdir()
        if p.is_dir() and (m := _NAME.match(p.name))
    ]
    return sorted(found, reverse=True)


def save_dcp(run_dir: Path, header: Header, model: nn.Module, optimizer: torch.optim.Optimizer, rt: Runtime) -> Path:
    """Collective: every rank writes its shard; rank 0 completes and renames the directory."""
    final = checkpoint_dir(run_dir, header.position.epoch, header.position.name_step)
    return write_shards(
        final,
        model,
        optimizer,
        lambda: header.to_dict(FORMAT),
        rt,
        "and the previous checkpoint is intact: free space (or fix the folder) and continue with --resume",
    )


def write_shards(
    final: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, meta: Any, rt: Runtime, advice: str = ""
) -> Path:
    """Collective, atomic as a whole: every rank writes its shards into `.NAME.partial/` (DCP
    writes .metadata on rank 0 once all are on disk), rank 0 adds ddpkit.pt (`meta()`, with the
    size and CRC-32 of every file, computed as they were written) and renames the folder to
    `final`. A failure leaves `final` as it was and removes the partial folder."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    tmp = final.parent / f".{final.name}.partial"
    try:
        if rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
            tmp.mkdir(parents=True)
        rt.barrier()
        if optimizer is None:
            state: dict[str, Any] = {"model": get_model_state_dict(model)}
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": whole_param_groups(model, optim_state)}
        writer = ChecksumWriter(tmp, sync_files=True)
        with _alone_is_fine():
            dcp.save(state, storage_writer=writer, no_dist=not rt.distributed)
        everyone = rt.gather_object(writer.sums)  # dcp.save returned: every rank's files are written
        if rt.is_main:  # and .metadata: DCP writes it on rank 0 once every shard is on disk
            files = {name: sums for rank_sums in everyone or [] for name, sums in rank_sums.items()}
            unlisted = sorted({p.name for p in tmp.iterdir()} - set(files))
            if unlisted or dcp_io.METADATA not in files:  # a header that lists less would be trusted by size
                raise RuntimeError(f"no checksum was recorded while writing {unlisted or dcp_io.METADATA}")
            ckpt_io.atomic_save({**meta(), LAYOUT: LAYOUT_VERSION, FILES: files}, tmp / META)
            ckpt_io.replace_folder(tmp, final)
    except (OSError, CheckpointException) as e:
        if rt.is_main:  # every rank is past its writes: DCP gathers their outcome before it raises
            shutil.rmtree(tmp, ignore_errors=True)
        raise DdpkitError(
            f"cannot write {final}: {_first_line(e)}; it was not renamed into place and its partial folder "
            "was removed" + (f" {advice}" if advice else "")
        ) from None
    rt.barrier()
    return final


def _first_line(e: BaseException) -> str:
    """Why a save failed, in a few words: a rank's OSError (a full disk) before the rest of DCP's report."""
    if isinstance(e, CheckpointException):
        errors = [exc for exc, _ in e.failures.values() if isinstance(exc, OSError)]
        e = errors[0] if errors else e
    lines = [line for line in str(e).splitlines() if line.strip()]
    return (getattr(e, "strerror", None) or (lines[-1] if lines else type(e).__name__))[:200]


def validate_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """ddpkit.pt of a complete sharded checkpoint that fits this model; a DdpkitError otherwise."""
    meta = read_complete(path)
    ckpt_io.check_signature(path, ckpt_io.signature_of(unwrap(model)), meta["model_signature"])
    if optimizer is not None and meta["optimizer_groups"] != ckpt_io.groups_of(unwrap(model), optimizer):
        raise DdpkitError(f"{path}: checkpoint's optimizer has different parameter groups than this task's optimizer")
    return meta


def read_complete(path: Path) -> dict[str, Any]:
    """ddpkit.pt of a sharded checkpoint whose every file is there and as written (any model);
    a DdpkitError otherwise."""
    meta = ckpt_io.load_file(path / META) if (path / META).is_file() else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DdpkitError(f"{path}: not a complete ddpkit sharded checkpoint (no {META})")
    if meta.get("version") not in ckpt_io.READABLE_VERSIONS:
        raise DdpkitError(
            f"{path}: sharded checkpoint version {meta.get('version')} is not supported "
            f"(this ddpkit writes {ckpt_io.VERSION})"
        )
    check_files(path, meta)
    return meta


def check_files(path: Path, meta: dict[str, Any]) -> None:
    """Every file of the folder as written: against the size and CRC-32 its header lists (before
    anything unpickles .metadata); every shard at least as long as the items DCP's metadata places
    in it; then every non-tensor item as plain data (a checksum an attacker rewrote proves nothing
    about what the item builds). A header of this layout lists every file; one that lists less is
    refused, never trusted by size: only a folder written before ddpkit kept checksums (no layout
    in its header) is read on its sizes, with a warning."""
    listed = meta.get(FILES) if isinstance(meta.get(FILES), dict) else None
    layout = meta.get(LAYOUT)
    if layout is not None and layout != LAYOUT_VERSION:
        raise DdpkitError(
            f"{path}: sharded checkpoint layout {layout!r} is not one this ddpkit reads ({LAYOUT_VERSION})"
        )
    if layout is not None and (not listed or dcp_io.METADATA not in listed):
        raise DamagedCheckpoint(
            f"{path}: its header lists no size and CRC-32 for {dcp_io.METADATA}: altered or damaged"
        )
    if listed is not None:
        verify_files(path, listed)
    metadata = folder_metadata(path)
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    if layout is not None and (missing := sorted(set(ends) - set(listed or {}))):
        raise DamagedCheckpoint(f"{path}: its header lists no size and CRC-32 for {missing[0]}: altered or damaged")
    if layout is None and listed is None:
        print(
            f"ddpkit: warning: {path} was written before ddpkit kept each file's CRC-32: its files are checked by "
            "size only (a changed byte goes unseen); its next save keeps them",
            file=sys.stderr,
            flush=True,
        )
    for name, end in sorted(ends.items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{path}: incomplete sharded checkpoint, missing {name}") from None
        if size < end:
            raise DamagedCheckpoint(f"{path / name}: truncated: {size:,} bytes, its items need {end:,}")
    check_items(path, metadata)


def load_dcp(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: read a sharded checkpoint into this run's model and optimizer, resharding
    to this run's layout (FSDP at any world size, TP's split Linears, a pipeline stage's part of
    the whole model's names, or whole tensors for DDP)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _alone_is_fine():  # one process resuming what a mesh wrote
        load_into(state, path, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def find_any_resumable(
    run_dir: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[str, dict[str, Any], Path, list[str]]:
    """The newest checkpoint that is complete and fits, of either kind: ("file", checkpoint,
    path, skipped) for a one-file (DDP) checkpoint, ("sharded", ddpkit.pt, path, skipped)
    for a directory (FSDP). At the same epoch a file comes first (it needs no collective read)."""
    candidates = sorted(
        [(e, 1, p) for e, p in ckpt_io.list_checkpoints(run_dir)] + [(e, 0, p) for e, p in list_sharded(run_dir)],
        reverse=True,
    )
    folder = Path(run_dir) / ckpt_io.CKPT_DIR
    if not candidates:
        raise DdpkitError(f"--resume: no checkpoint in {folder}; run without --resume to start fresh")
    skipped: list[str] = []
    for _, is_file, path in candidates:
        try:
            if is_file:
                ckpt = ckpt_io.load_file(path)
                ckpt_io.validate_checkpoint(ckpt, path, unwrap(model), optimizer)
                return "file", ckpt, path, skipped
            return "sharded", validate_sharded(path, model, optimizer), path, skipped
        except DdpkitError as e:
            skipped.append(str(e))
    raise DdpkitError(f"--resume: no usable checkpoint in {folder}: " + " | ".join(skipped))


STATE_FORMAT = "ddpkit-sharded-state"


def save_state_dir(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    rt: Runtime,
) -> Path:
    """For own loops (rt.save(..., sharded=True)); collective: every rank writes its shard
    into `.NAME.partial/`, rank 0 adds ddpkit.pt (the extras) and renames it to `path`."""

    def meta() -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "extra": extra,
            "world_size": rt.world_size,
            "has_optimizer": optimizer is not None,
            "model_signature": ckpt_io.model_signature(unwrap(model).state_dict()),
        }

    return write_shards(Path(path), model, optimizer, meta, rt)


def load_state_dir(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Collective: what save_state_dir wrote, into this model's layout (any world size,
    sharded or not); returns the extras."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(path)
    meta = ckpt_io.load_file(path / META) if (path / META).is_file() else None
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise DdpkitError(f"{path}: not a complete sharded save of rt.save(..., sharded=True) (no {META})")
    check_files(path, meta)
    ckpt_io.check_signature(path, ckpt_io.model_signature(unwrap(model).state_dict()), meta["model_signature"])
    if optimizer is not None and not meta.get("has_optimizer"):
        raise DdpkitError(f"{path}: holds no optimizer state")
    no_dist = not dist.is_initialized()
    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        with _alone_is_fine():
            load_into(state, path, no_dist)
        set_model_state_dict(model, state["model"])
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        with _alone_is_fine():
            load_into(state, path, no_dist)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta.get("extra", {})


@contextlib.contextmanager
def _alone_is_fine() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: that is what an
    own loop run with plain `python` means, not a mistake to warn about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
