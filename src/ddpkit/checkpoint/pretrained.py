"""Pretrained weights into this rank's part of the model, read by slice.

A source is a safetensors file, a Hugging Face folder (`model.safetensors`, or shards named
by `model.safetensors.index.json`, or `pytorch_model.bin`), or a torch state dict file
(ddpkit's model.pt). safetensors files are opened with `safe_open` and each rank reads only
the rows it keeps (`get_slice`); a torch file is memory-mapped, so slicing it reads only
those pages too. Everything is checked from the headers before any weight is read: a key
the model lacks, one it has that the file lacks, a shape that differs, a file that cannot
be read, each is one line naming the first of them. Buffers the file does not hold keep
their initialised values; a parameter tied to another (a head sharing the embedding's
matrix) is found under any of its names.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import DdpkitError
from .file import not_plain_data


@dataclass
class ModelTensor:
    """One tensor of the model under every name it has (tied parameters have several)."""

    names: list[str]
    tensor: torch.Tensor
    is_param: bool


def tensor_names(model: nn.Module) -> list[ModelTensor]:
    """The model's parameters and persistent buffers (what a state dict holds), once each."""
    found: dict[int, ModelTensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(p), ModelTensor([], p, True)).names.append(name)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for b_name, b in module._buffers.items():
            if b is not None and b_name not in module._non_persistent_buffers_set:
                name = f"{mod_name}.{b_name}" if mod_name else b_name
                found.setdefault(id(b), ModelTensor([], b, False)).names.append(name)
    return list(found.values())


@dataclass
class Pretrained:
    """An opened source: each key's shape, where to read it, and which model tensors it fills."""

    path: str
    shapes: dict[str, tuple[int, ...]]
    files: dict[str, str] = field(default_factory=dict)  # key -> safetensors file
    state: dict[str, torch.Tensor] | None = None  # a torch file, memory-mapped
    covered: set[int] = field(default_factory=set)  # ids of the model tensors the file fills
    _handles: dict[str, Any] = field(default_factory=dict)

    def read(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of `key`, for the model tensor `t` (a DTensor's slice, or all of it)."""
        region = None
        if hasattr(t, "placements"):
            shape, offset = local_shape_and_offset(t)
            region = tuple(slice(o, o + n) for n, o in zip(shape, offset, strict=True))
        if self.state is not None:
            value = self.state[key]
            return value[region] if region else value
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = _safe_open(file)
        handle = self._handles[file]
        if not region or len(self.shapes[key]) == 0:
            return handle.get_tensor(key)
        return handle.get_slice(key)[region]

    def close(self) -> None:
        self._handles.clear()
        self.state = None


def open_pretrained(path: str | os.PathLike[str], model_tensors: list[ModelTensor]) -> Pretrained:
    """Open `path` and check its keys and shapes against the model's; reads no weights."""
    source = _open(str(path))
    _match(source, model_tensors)
    return source


def load_pretrained(model: nn.Module, source: Pretrained) -> None:
    """Copy the file's weights into the model's tensors (this rank's part of each)."""
    with torch.no_grad():
        for mt in tensor_names(model):
            key = next((n for n in mt.names if n in source.shapes), None)
            if key is not None:
                local = mt.tensor.to_local() if hasattr(mt.tensor, "to_local") else mt.tensor
                local.copy_(source.read(key, mt.tensor))


def _match(source: Pretrained, model_tensors: list[ModelTensor]) -> None:
    where = f"pretrained weights {source.path}"
    names = {n for mt in model_tensors for n in mt.names}
    if source.shapes and not names & set(source.shapes):
        first_model = model_tensors[0].names[0] if model_tensors else "(none)"
        raise DdpkitError(
            f"{where}: none of its keys is the model's (the file's first is {next(iter(source.shapes))!r}, "
            f"the model's {first_model!r}): the weights of another model? Give the file saved from this model"
        )
    unexpected = [k for k in source.shapes if k not in names]
    if unexpected:
        raise DdpkitError(
            f"{where}: key {unexpected[0]!r} is not in the model ({len(unexpected)} such key(s)): "
            "the file of another model or another version of it? Give weights saved from this model"
        )
    for mt in model_tensors:
        key = next((n for n in mt.names if n in source.shapes), None)
        if key is None:
            if mt.is_param:
                raise DdpkitError(
                    f"{where}: the model's parameter {mt.names[0]!r} is not in the file: "
                    "give weights saved from this model (all its parameters)"
                )
            continue  # a buffer the file lacks keeps its initialised value
        if tuple(mt.tensor.shape) != source.shapes[key]:
            raise DdpkitError(
                f"{where}: {key!r} has shape {list(source.shapes[key])} in the file but "
                f"{list(mt.tensor.shape)} in the model: build the model with the file's configuration"
            )
        source.covered.add(id(mt.tensor))


def _open(path: str) -> Pretrained:
    p = Path(path)
    if not p.exists():
        raise DdpkitError(f"pretrained weights {path}: no such file or folder")
    if p.is_dir():
        index, single, torch_file = p / "model.safetensors.index.json", p / "model.safetensors", p / "pytorch_model.bin"
        if index.is_file():
            return _open_index(path, index)
        if single.is_file():
            return _open_safetensors(path, [str(single)])
        if torch_file.is_file():
            return _open_torch(path, torch_file)
        raise DdpkitError(
            f"pretrained weights {path}: the folder holds no model.safetensors, model.safetensors.index.json "
            "or pytorch_model.bin: give a folder written by save_pretrained, or the weights file itself"
        )
    if p.suffix == ".safetensors":
        return _open_safetensors(path, [path])
    return _open_torch(path, p)


def _open_index(path: str, index: Path) -> Pretrained:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise DdpkitError(f"pretrained weights {path}: {index.name} is not a safetensors index ({e})") from None
    return _open_safetensors(path, sorted({str(index.parent / f) for f in weight_map.values()}))


def _open_safetensors(path: str, files: list[str]) -> Pretrained:
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for file in files:
        handle = _safe_open(file, path)
        for key in handle.keys():
            shapes[key] = tuple(handle.get_slice(key).get_shape())
            where[key] = file
    return Pretrained(path, shapes, files=where)


def _safe_open(file: str, path: str | None = None) -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise DdpkitError(
            "reading safetensors weights needs the safetensors package: pip install 'ddpkit[hf]'"
        ) from None
    if not os.path.isfile(file):
        raise DdpkitError(f"pretrained weights {path or file}: {file} is missing")
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error type for a bad or truncated header
        raise DdpkitError(
            f"pretrained weights {path or file}: {file} is not a readable safetensors file "
            f"(truncated or another format? {str(e).splitlines()[0][:160]})"
        ) from None


def _open_torch(path: str, file: Path) -> Pretrained:
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise DdpkitError(f"pretrained weights {path}: refused to load {file}: {not_plain_data(e)}") from None
    except Exception as e:
        raise DdpkitError(
            f"pretrained weights {path}: not a readable torch state dict or safetensors file "
            f"(truncated or another format? {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a checkpoint holding the model's state dict under "model"
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DdpkitError(f"pretrained weights {path}: the file holds no state dict of tensors (name -> tensor)")
    return Pretrained(path, {k: tuple(v.shape) for k, v in state.items()}, state=state)


def local_shape_and_offset(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and the global offset of this rank's part of a DTensor, from its placements."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)
