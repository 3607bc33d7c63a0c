"""Is a checkpoint exactly what was written? A CRC-32 of every byte, checked before it is trained from.

Why CRC-32 (zlib's): a checkpoint is guarded against accidents (a flipped bit on a disk or in a
copy, a file cut short), not against an attacker, who could rewrite any checksum beside the
data (planted files are kept out by the run directory's permissions). For accidents a 32-bit CRC
misses one damaged file in 4 billion, and any burst up to 32 bits always. It is the cheapest
of the candidates measured (benchmarks/checkpoint_verify.py: zlib.crc32 3.4 GB/s, SHA-256
0.7 GB/s on this machine; CRC-32C 6.6 GB/s but needs a package), and it is the checksum torch's
own file format already holds: a one-file checkpoint (torch.save's zip) carries the CRC-32 of
each of its records, computed by torch while it writes, so saving costs nothing more; torch
never checks them when it loads (its zip reader is built without the check), ddpkit does, here.
A sharded checkpoint's files are DCP's own format (no checksum): the CRC-32 of each file is
computed while it is written (dcp_io.py) and kept in the folder's header (ddpkit.pt), itself a
torch zip with its own CRCs.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any

from ..errors import DdpkitError
from ..util.checksum import CHUNK, crc32_of

__all__ = ["DamagedCheckpoint", "WriteThrough", "crc32_of", "is_torch_zip", "verify_files", "verify_zip"]


class DamagedCheckpoint(DdpkitError):
    """A file of a checkpoint is not what was written (bits changed, cut short, or missing)."""


class WriteThrough:
    """A file torch writes through. It keeps the first OSError a write raised (torch turns it
    into a RuntimeError of its own, `unexpected pos`, that no longer says the disk is full) and,
    with `crc`, the size and CRC-32 of what passed: a checksum while writing, no second read."""

    def __init__(self, raw: IO[bytes], crc: bool = False) -> None:
        self.raw = raw
        self.checksum = crc
        self.crc = 0
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            n = self.raw.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        if self.checksum:
            view = memoryview(data).cast("B")
            self.crc = zlib.crc32(view, self.crc)
            self.size += view.nbytes
        return n if n is not None else memoryview(data).nbytes

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def __enter__(self) -> WriteThrough:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def is_torch_zip(path: str | os.PathLike) -> bool:
    """Whether a file starts like a zip (torch.save's format since 1.6)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def verify_zip(path: str | os.PathLike) -> None:
    """Every record of a torch.save file against the CRC-32 torch wrote for it; a
    DamagedCheckpoint naming the file and what is wrong otherwise."""
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb", buffering=0) as raw:
            buffer = bytearray(CHUNK)
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED:  # not torch's: zipfile reads and checks it
                    with archive.open(info) as record:  # raises BadZipFile on a wrong CRC-32 at its end
                        while record.read(CHUNK):
                            pass
                elif _stored_crc(raw, info, buffer) != info.CRC:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")
    except zipfile.BadZipFile as e:
        raise DamagedCheckpoint(f"{path}: damaged: {_zip_problem(path, e)}") from None
    except (OSError, EOFError, ValueError, zipfile.LargeZipFile, NotImplementedError) as e:
        raise DamagedCheckpoint(f"{path}: damaged: unreadable ({type(e).__name__}: {e})"[:400]) from None


def _stored_crc(raw: Any, info: zipfile.ZipInfo, buffer: bytearray) -> int:
    """The CRC-32 of an uncompressed record's bytes, read into one reused buffer (no copy per
    chunk, unlike zipfile's reader: the check runs at the speed of the CRC). Its local header
    must name the same record as the zip's directory."""
    head = os.pread(raw.fileno(), 30, info.header_offset)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"no local header for {info.filename!r}")
    name_len, extra_len = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
    name = os.pread(raw.fileno(), name_len, info.header_offset + 30)
    if name.decode("utf-8", "replace") != info.filename:
        raise zipfile.BadZipFile(f"the local header of {info.filename!r} names another record")
    raw.seek(info.header_offset + 30 + name_len + extra_len)
    view, crc, left = memoryview(buffer), 0, info.compress_size
    while left:
        got = raw.readinto(view[: min(left, len(buffer))])
        if not got:
            raise zipfile.BadZipFile(f"{info.filename!r} ends early")
        crc = zlib.crc32(view[:got], crc)
        left -= got
    return crc


def _zip_problem(path: str | os.PathLike, e: zipfile.BadZipFile) -> str:
    text = str(e)
    if text.startswith("Bad CRC-32"):
        record = text.split("'")[1] if "'" in text else "a record"
        return f"{record} fails its CRC-32 check (bytes changed after it was written: a bad disk, memory or copy)"
    if "not a zip file" in text.lower():
        if is_torch_zip(path):
            return "truncated (its zip directory, written last, is missing)"
        return "not a torch checkpoint file (no zip header: random bytes, or another format)"
    return f"its zip structure is broken ({text[:160]})"


def verify_files(folder: Path, manifest: dict[str, Any]) -> None:
    """Every file of a sharded checkpoint against the (size, CRC-32) written beside its header:
    missing and truncated files are told by their size first (no read), then every byte is checked."""
    for name, (size, _) in sorted(manifest.items()):
        path = folder / name
        try:
            have = path.stat().st_size
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{path}: missing (the checkpoint's header lists it)") from None
        if have != size:
            how = "truncated" if have < size else "longer than written"
            raise DamagedCheckpoint(f"{path}: {how}: {have:,} bytes, written with {size:,}")
    for name, (_, crc) in sorted(manifest.items()):
        path = folder / name
        if crc32_of(path)[1] != crc:
            raise DamagedCheckpoint(
                f"{path}: damaged: it fails its CRC-32 check (bytes changed after it was written: a bad disk, "
                "memory or copy)"
            )
