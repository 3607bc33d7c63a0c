#!/usr/bin/env python
"""What checking a checkpoint's CRC-32s costs, on a ~1 GB checkpoint of each kind, side by side
with what saving and loading it costs anyway; and the checksums one could use, by throughput.

    python benchmarks/checkpoint_verify.py [--gib 1.0] [--rounds 3] [--dir /tmp]
                                           [--out benchmarks/results/checkpoint_verify.md]

- checksums: zlib.crc32 (ddpkit's, and torch's zip format's), SHA-256, and CRC-32C where the
  `crc32c` package is installed, over 256 MiB in memory (best of rounds).
- one file (DDP): torch.save with the CRC-32 of each record computed (torch's default; ddpkit
  makes sure of it) and without it: what the checksum adds at save; then torch.load
  (weights_only) and file.check_file (every record against its CRC-32, what --resume and export
  do before loading).
- sharded (FSDP: torch.distributed.checkpoint, one process writing one shard file): DCP's own
  writer and ddpkit's ChecksumWriter (a CRC-32 of every byte as it is written); then DCP's load
  and integrity.verify_files.
Files stay in the page cache between the write and the reads (what a resume right after a
crash sees; a cold read adds the disk's time to the load and the check alike). Medians of
--rounds, each kind's variants interleaved.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddpkit.checkpoint import file as ck  # noqa: E402
from ddpkit.checkpoint.dcp_io import ChecksumWriter, load_into  # noqa: E402
from ddpkit.checkpoint.integrity import verify_files  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def checksums(rounds: int) -> list[tuple[str, float]]:
    data = os.urandom(256 << 20)
    candidates = [("zlib.crc32", lambda: zlib.crc32(data)), ("SHA-256", lambda: hashlib.sha256(data).digest())]
    try:
        import crc32c

        candidates.append(("CRC-32C (crc32c package)", lambda: crc32c.crc32c(data)))
    except ImportError:
        pass
    return [(name, len(data) / min(timed(fn) for _ in range(rounds)) / 1e9) for name, fn in candidates]


def state_of(gib: float) -> dict[str, torch.Tensor]:
    n = int(gib * 2**30 / 4 / 8)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(8)}


def save_synced(state: dict, path: Path, crc: bool) -> None:
    """torch.save into an open file, then fsync: atomic_save's write, with or without the CRC-32s."""
    from torch.serialization import set_crc32_options

    set_crc32_options(crc)
    try:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    finally:
        set_crc32_options(True)


def one_file(state: dict, folder: Path, rounds: int) -> dict[str, list[float]]:
    path = folder / "epoch-000001.pt"
    saves = {
        "save, CRC-32s computed": lambda: save_synced(state, path, True),
        "save, no CRC-32": lambda: save_synced(state, path, False),
    }
    out: dict[str, list[float]] = {**{k: [] for k in saves}, "atomic_save (ddpkit's)": [], "load": [], "check": []}
    for r in range(rounds):
        for name in list(saves)[:: 1 if r % 2 == 0 else -1]:  # A B, B A, ...: a drifting machine hits both alike
            out[name].append(timed(saves[name]))
        out["atomic_save (ddpkit's)"].append(timed(lambda: ck.atomic_save(state, path)))
        out["check"].append(timed(lambda: ck.check_file(path)))
        out["load"].append(timed(lambda: torch.load(path, map_location="cpu", weights_only=True)))
    return out


def sharded(state: dict, folder: Path, rounds: int) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp

    out: dict[str, list[float]] = {"save, CRC-32 while writing": [], "save, no CRC-32 (DCP's writer)": []}
    out.update(load=[], check=[])
    sums: dict = {}
    for r in range(rounds):
        plain, summed = folder / f"plain{r}", folder / f"summed{r}"

        def save(p: Path = summed) -> None:
            writer = ChecksumWriter(p)
            dcp.save(state, storage_writer=writer, no_dist=True)
            sums.update(writer.sums)

        saves = {
            "save, CRC-32 while writing": save,
            "save, no CRC-32 (DCP's writer)": lambda p=plain: dcp.save(
                state, storage_writer=dcp.FileSystemWriter(p), no_dist=True
            ),
        }
        for name in list(saves)[:: 1 if r % 2 == 0 else -1]:
            out[name].append(timed(saves[name]))
        out["check"].append(timed(lambda p=summed: verify_files(p, sums)))
        empty = {k: torch.empty_like(v) for k, v in state.items()}
        out["load"].append(timed(lambda p=summed, e=empty: load_into(e, p, no_dist=True)))
        shutil.rmtree(plain)
        shutil.rmtree(summed)
    return out


def table(title: str, size: int, rows: dict[str, list[float]], crc_rate: float) -> list[str]:
    lines = [f"### {title} ({size / 1e9:.2f} GB)", "", "| step | median s | GB/s | range s |", "|---|---|---|---|"]
    for name, times in rows.items():
        med = statistics.median(times)
        lines.append(f"| {name} | {med:.3f} | {size / med / 1e9:.2f} | {min(times):.3f}-{max(times):.3f} |")
    load, check = statistics.median(rows["load"]), statistics.median(rows["check"])
    with_sum, without = (statistics.median(times) for name, times in rows.items() if name.startswith("save, "))
    added = with_sum - without
    lines += [
        "",
        f"the check before a resume adds {check:.3f} s to a {load:.3f} s load ({100 * check / load:.0f}%); "
        f"the checksum at save: {added:+.3f} s on {without:.3f} s ({100 * added / without:+.0f}%; "
        f"computing a CRC-32 of {size / 1e9:.2f} GB alone takes ~{size / crc_rate:.3f} s here)",
        "",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = ["## Checksums, over 256 MiB in memory (best of rounds)", "", "| checksum | GB/s |", "|---|---|"]
    rates = checksums(args.rounds)
    lines += [f"| {name} | {rate:.2f} |" for name, rate in rates] + [""]
    crc_rate = rates[0][1] * 1e9
    state = state_of(args.gib)
    size = sum(t.numel() * t.element_size() for t in state.values())
    folder = Path(tempfile.mkdtemp(prefix="ddpkit-verify-bench-", dir=args.dir))
    try:
        files = one_file(state, folder, args.rounds)
        lines += table("one file (DDP): torch.save's zip, a CRC-32 per record", size, files, crc_rate)
        shards = sharded(state, folder, args.rounds)
        lines += table("sharded (FSDP): DCP's files, a CRC-32 per file", size, shards, crc_rate)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
