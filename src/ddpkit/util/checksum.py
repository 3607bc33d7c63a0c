"""The checksum of ddpkit's checkpoints, one file at a time: what a local checkpoint's header
and a bucket's manifest both record (checkpoint/integrity.py says why CRC-32)."""

from __future__ import annotations

import os
import zlib

CHUNK = 8 << 20  # bytes read at a time


def crc32_of(path: str | os.PathLike) -> tuple[int, int]:
    """(size, CRC-32) of a file, read once."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc
