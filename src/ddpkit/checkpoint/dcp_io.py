"""torch.distributed.checkpoint's files, read without running code and written with a CRC-32 per file.

Why: DCP reads a folder's `.metadata` with a plain unpickler and the non-tensor items of its shards
(an optimizer's lr, betas, ...) with a torch.load that may build any object, so a crafted folder
would run its code at `--resume` or `ddpkit export`. Here `.metadata` goes through an unpickler
that builds only what DCP's metadata is made of (its own metadata classes, torch sizes, dtypes and
layouts, paths and plain containers) before torch sees it, and shard items load as plain data
(weights_only=True). What this lets through is data, never a callable chosen by the file.

Writing, every file DCP creates passes through a CRC-32 as it is written (integrity.py), so the
checkpoint's header can list each file's size and checksum without reading any of them again.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from ..errors import DdpkitError
from .file import not_plain_data
from .integrity import DamagedCheckpoint, WriteThrough

METADATA = ".metadata"

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *(
        (_METADATA_MODULE, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # a name -> one of torch's layouts
    ("collections", "OrderedDict"),
    *(("builtins", name) for name in ("set", "frozenset", "slice", "complex")),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes of DCP's metadata, torch's dtypes and the few plain types above."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def load_metadata(path: str | os.PathLike) -> Metadata:
    """A `.metadata` file, unpickled through the allow-list; a DdpkitError naming the file for
    anything else (a crafted file, garbage, another version's classes)."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise DdpkitError(f"{path}: missing (a sharded checkpoint's DCP metadata)") from None
    except pickle.UnpicklingError as e:
        raise DdpkitError(f"{path}: refused to load: {e} (a file crafted to run code, or not DCP's)") from None
    except Exception as e:  # garbage makes the unpickler fail in many ways
        raise DdpkitError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {str(e)[:160]})") from None
    if not isinstance(metadata, Metadata):
        raise DdpkitError(f"{path}: not DCP metadata (it holds a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        where = getattr(info, "relative_path", None)
        plain = isinstance(where, str) and Path(where).name == where and where not in ("", ".", "..")
        if not isinstance(info, _StorageInfo) or not plain:
            raise DdpkitError(f"{path}: refused: a shard is named {where!r}, not a file of this folder")
    return metadata


def folder_metadata(folder: str | os.PathLike) -> Metadata:
    return load_metadata(Path(folder) / METADATA)


def check_items(folder: str | os.PathLike, metadata: Metadata) -> None:
    """Every non-tensor item of the folder's shards (an optimizer's lr, betas, ...) loads as plain
    data. Checked where a resume chooses its checkpoint (rank 0, before any rank loads), so that a
    crafted item makes that checkpoint one to skip, as a damaged one is, not a failed load on every
    rank. The items are a few hundred bytes each; tensors are not read here."""
    folder = Path(folder)
    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda kv: kv[1].offset):
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        where = folder / info.relative_path
        if info.transform_descriptors:  # ddpkit's writer adds none (no compression)
            raise DdpkitError(f"{where}: refused {index.fqn}: written with transforms ddpkit does not use")
        with open(where, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise DamagedCheckpoint(f"{where}: truncated: {index.fqn} ends past the end of the file")
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            raise DdpkitError(f"{where}: refused to load {index.fqn}: {not_plain_data(e)}") from None
        except Exception as e:  # garbage makes the unpickler fail in many ways
            raise DamagedCheckpoint(f"{where}: {index.fqn} is unreadable ({type(e).__name__})") from None


class SafeReader(FileSystemReader):
    """DCP's reader of a folder, whose metadata comes through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with the shards' non-tensor items loaded as plain data only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise DdpkitError(f"refused to load {read_item.dest_index.fqn}: {not_plain_data(e)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_into(state: dict[str, Any], folder: str | os.PathLike, no_dist: bool) -> None:
    """dcp.load of `folder` into `state` (in place), safely; a refusal is one DdpkitError (DCP
    wraps what its reader raised into an exception of every rank's tracebacks)."""
    import torch.distributed.checkpoint as dcp

    folder_metadata(folder)  # refused here, in one line, before DCP reads anything
    try:
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafePlanner(), no_dist=no_dist)
    except CheckpointException as e:
        failures = [exc for exc, _ in e.failures.values()]
        refused = [exc for exc in failures if isinstance(exc, DdpkitError)]
        if refused:
            raise DdpkitError(str(refused[0])) from None
        crafted = [exc for exc in failures if isinstance(exc, pickle.UnpicklingError)]  # a tensor item, read by DCP
        if crafted:
            raise DdpkitError(f"{folder}: refused to load a shard's tensor: {not_plain_data(crafted[0])}") from None
        raise


class _ChecksumFileSystem(FileSystem):
    """DCP's file system, with every file opened for writing passed through a CRC-32; a rename
    carries the checksum to the new name (.metadata.tmp -> .metadata)."""

    def __init__(self, sums: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.sums = sums

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            sink = WriteThrough(raw, crc=True)  # type: ignore[arg-type]
            try:
                yield sink
            except RuntimeError:
                if sink.error is not None:  # torch's `unexpected pos`: the write's own error says why (a full disk)
                    raise sink.error from None
                raise
        self.sums[Path(path).name] = (sink.size, sink.crc)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.sums:
            self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


class ChecksumWriter(FileSystemWriter):
    """DCP's writer; `sums`: the (size, CRC-32) of each file this rank wrote, by name."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.sums: dict[str, tuple[int, int]] = {}
        self.fs = _ChecksumFileSystem(self.sums)
