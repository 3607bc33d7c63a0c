"""`ddpkit export`: a run's model leaves as safetensors files, or as a folder Hugging Face's
`from_pretrained` loads (the weights plus the model's config, hf_config.py).

The weights come from the run's newest (or a named) checkpoint of either kind, or its
model.pt, and are written one output file at a time: a one-file checkpoint is memory-mapped
(a tensor's pages are read when it is written), a sharded one (FSDP) is read with
torch.distributed.checkpoint in this one process, only the tensors of the file being written
(DCP assembles each from whichever rank's shards hold it). So the export holds about one output
file in memory, never the whole model, and needs no process group nor the task.

Files as Hugging Face writes them: `model.safetensors`, or, above --max-shard-size,
`model-0000K-of-0000N.safetensors` and `model.safetensors.index.json` (which file holds each
tensor). Atomic: everything is written into a temporary folder beside the output, which is
renamed into place at the end; a failure leaves no output at all.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..config.output import check_export_format
from ..config.values import format_bytes, parse_memory
from ..errors import DdpkitError
from . import file as ckpt_file
from . import hf_config
from .file import _first_line, not_plain_data

DEFAULT_MAX_SHARD_SIZE = "5GB"  # Hugging Face's default
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MODEL_PT = "model.pt"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class Source(Protocol):
    """Where the weights are read from: the model's tensors (names, shapes, dtypes, in the
    model's order) and the values of some of them."""

    path: Path
    tensors: list[TensorInfo]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]: ...


class FileSource:
    """model.pt (plain weights) or a one-file checkpoint (its "model"), memory-mapped: a tensor's
    pages are read from disk when it is written out, and each group of tensors is mapped anew and
    let go once written (the pages of a mapping stay resident while it lives)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors = [TensorInfo(k, tuple(v.shape), v.dtype) for k, v in self._load(check=True).items()]

    def _load(self, check: bool = False) -> dict[str, torch.Tensor]:
        path = self.path
        if check:
            ckpt_file.check_file(path)
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:
            raise DdpkitError(f"{path}: refused to load: {not_plain_data(e)}") from None
        except Exception as e:  # garbage makes the unpickler fail in many ways
            raise DdpkitError(f"{path}: not a readable checkpoint, truncated or corrupt ({_first_line(e)})") from None
        ddpkit_file = isinstance(loaded, dict) and isinstance(loaded.get("format"), str) and "model" in loaded
        state = loaded["model"] if ddpkit_file else loaded  # a checkpoint (or rt.save's file): its model
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise DdpkitError(f"{path}: holds no model weights (neither ddpkit's model.pt nor a ddpkit checkpoint)")
        return state

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        state = self._load()
        return {n: state[n] for n in names}


class ShardedSource:
    """A sharded checkpoint's model (every rank's shards), read in this process tensor group by
    tensor group: DCP fills whole tensors of the shapes its metadata records."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from .dcp_io import folder_metadata
        from .sharded import read_complete

        self.path = path
        meta = read_complete(path)  # every file as written
        stored = folder_metadata(path).state_dict_metadata
        order = list(meta.get("model_signature") or [k.removeprefix("model.") for k in stored])
        self.tensors = []
        for name in order:
            info = stored.get(f"model.{name}")
            if not isinstance(info, TensorStorageMetadata):
                raise DdpkitError(
                    f"{path}: the model's {name} is {'not in the checkpoint' if info is None else 'not a tensor'}; "
                    "safetensors holds tensors only"
                )
            self.tensors.append(TensorInfo(name, tuple(info.size), info.properties.dtype))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from .dcp_io import load_into
        from .sharded import _alone_is_fine

        infos = {t.name: t for t in self.tensors}
        state = {"model": {n: torch.empty(infos[n].shape, dtype=infos[n].dtype) for n in names}}
        with _alone_is_fine():
            load_into(state, self.path, no_dist=True)
        return state["model"]


def plan_files(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """The names in each output file, in order: a file takes tensors until the next one would
    pass `max_bytes`; a tensor larger than that gets a file of its own (as Hugging Face splits)."""
    files: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not files or (files[-1] and used + size > max_bytes):
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def file_names(n: int) -> list[str]:
    """model.safetensors, or model-00001-of-0000N.safetensors ... (Hugging Face's names)."""
    return [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def find_source(run_dir: Path, name: str | None = None) -> Path:
    """The checkpoint `name` (a name in RUN_DIR/checkpoints, with or without .pt, model.pt, or a
    path), or by default the run's newest weights: its newest checkpoint of either kind, or
    model.pt when that is at least as new (a finished run writes it after its last checkpoint)."""
    from .retention import all_checkpoints

    found = [path for _, path in all_checkpoints(run_dir)]
    final = run_dir / MODEL_PT
    if name:
        folder = run_dir / ckpt_file.CKPT_DIR
        for candidate in (folder / name, folder / f"{name}.pt", run_dir / name, Path(name)):
            if candidate.exists() and candidate.name not in ("", ".", ckpt_file.CKPT_DIR):
                return candidate
        known = [p.name for p in found] + ([MODEL_PT] if final.is_file() else [])
        raise DdpkitError(
            f"--checkpoint {name}: no such checkpoint in {run_dir} (it has: {', '.join(known) or 'none'})"
        )
    if not found and not final.is_file():
        raise DdpkitError(
            f"{run_dir}: no checkpoint and no {MODEL_PT} to export: train into it first (or name a checkpoint "
            "with --checkpoint)"
        )
    if final.is_file() and (not found or _mtime(final) >= _mtime(found[0])):
        return final
    return found[0]


def _mtime(path: Path) -> int:
    from .sharded import META

    written = path / META if path.is_dir() else path  # a sharded checkpoint's ddpkit.pt is written last
    return written.stat().st_mtime_ns if written.exists() else 0


def open_source(path: Path) -> Source:
    return ShardedSource(path) if path.is_dir() else FileSource(path)


def export_run(
    run_dir: str | os.PathLike,
    fmt: str,
    out: str | os.PathLike | None = None,
    checkpoint: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    replace: bool = False,
    say: Callable[[str], None] = lambda line: None,
) -> Path:
    """Write the run's model as `fmt` ("safetensors" or "hf") into `out` (RUN_DIR/export by
    default), which must not exist or be empty unless `replace` (the end of `ddpkit train`
    replaces its own export/). Returns the folder."""
    check_export_format("--format", fmt)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DdpkitError(f"{run_dir}: no such run directory (the --run-dir of a `ddpkit train`)")
    max_bytes = parse_memory(max_shard_size, "--max-shard-size")
    assert max_bytes is not None
    extra, skip = hf_config.read(run_dir) if fmt == "hf" else ([], {})
    target = Path(out) if out is not None else run_dir / "export"
    if not replace and target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise DdpkitError(f"{target} already exists and is not empty: choose another --out, or remove it")
    source = open_source(find_source(run_dir, checkpoint))
    tensors = [t for t in source.tensors if t.name not in skip]
    if not tensors:
        raise DdpkitError(f"{source.path}: the model holds no tensors to export")
    say(f"ddpkit: exporting {source.path} as {fmt} to {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        written = write_weights(tmp, source, plan_files([(t.name, t.nbytes) for t in tensors], max_bytes))
        for path in extra:
            shutil.copyfile(path, tmp / path.name)
        _put_in_place(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DdpkitError(f"cannot write {target}: {e.strerror or e}; nothing was left there") from None
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if type(e).__name__ == "SafetensorError" and "I/O error" in str(e):  # safetensors' own OSError
            why = str(e).split("I/O error:", 1)[1].split("(os error")[0].strip()
            raise DdpkitError(f"cannot write {target}: {why}; nothing was left there") from None
        raise
    say(f"ddpkit: wrote {target}: {written} ({len(tensors)} tensors)")
    return target


def write_weights(folder: Path, source: Source, files: list[list[str]]) -> str:
    """Each output file in turn, read and written alone; the index when there are several."""
    save_file = _safetensors_save()
    names = file_names(len(files))
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, group in zip(names, files, strict=True):
        tensors = _unshared(source.read(group))
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(group, file_name))
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return f"{len(files)} file{'s' if len(files) > 1 else ''}, {format_bytes(total)}"


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing memory with another (safetensors refuses both): a
    tensor that shares its storage with an earlier one is copied."""
    seen: set[int] = set()
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        plain[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    return plain


def _safetensors_save() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise DdpkitError("export needs the safetensors package: pip install 'ddpkit[export]'") from None
    return save_file


def _put_in_place(tmp: Path, target: Path) -> None:
    """Rename the finished folder to `target`; an existing one (empty, or the run's own export/
    being replaced) goes only once the new one is complete."""
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)  # as open() would create them, not mkdtemp's private 0700 folder
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    tmp.chmod(0o777 & ~umask)
    ckpt_file.replace_folder(tmp, target)
