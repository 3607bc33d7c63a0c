"""A damaged checkpoint is never trained from: flipped bits or a cut in the newest checkpoint (a
DDP file, an FSDP shard) are found by their CRC-32 at --resume, which names the file, says
what is wrong and resumes from the previous one to the uninterrupted run's model; `ddpkit runs`
shows it and `ddpkit export` refuses it (the resumed run writes that checkpoint again)."""

import shutil
import zipfile
from pathlib import Path

import pytest

from conftest import assert_state_equal, load_model, run_ddpkit

WINE = ("--nproc", "2", "--seed", "5", "--save-every", "2", "--epochs", "6", "--quiet")


def _flip_in_tensor_data(path: Path) -> None:
    """One bit of the largest record of a torch.save file (its tensor data, not the zip's structure)."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    head = raw[info.header_offset : info.header_offset + 30]
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    raw[start + info.file_size // 2] ^= 0x04
    path.write_bytes(bytes(raw))


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    path.write_bytes(bytes(raw))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CASES = {
    "ddp-flipped": ((), "epoch-000006.pt", _flip_in_tensor_data, "fails its CRC-32 check"),
    "ddp-truncated": ((), "epoch-000006.pt", _cut, "damaged: truncated"),
    "fsdp-flipped-shard": (("--strategy", "fsdp"), "epoch-000006/__1_0.distcp", _flip, "fails its CRC-32 check"),
    "fsdp-truncated-shard": (("--strategy", "fsdp"), "epoch-000006/__0_0.distcp", _cut, "truncated:"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_newest_checkpoint_is_named_skipped_and_the_previous_one_resumes_exactly(
    case, tmp_path, reference_run
):
    strategy, damaged, damage, why = CASES[case]
    reference = reference_run(*strategy, *WINE)
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for name in ("model.pt", "summary.json"):
        (run / name).unlink()  # what the resumed run writes again
    damage(run / "checkpoints" / damaged)

    runs = run_ddpkit("runs", str(run)).stdout.splitlines()
    assert runs[1].split()[-1] == "yes*" and runs[2] == "checkpoints a --resume skips:", runs
    assert damaged in runs[3] and why in runs[3], runs

    export = run_ddpkit("export", str(run), "--checkpoint", damaged.split("/")[0], check=False)
    assert export.returncode == 2 and why in export.stderr and "Traceback" not in export.stderr, export.stderr
    assert not (run / "export").exists()

    proc = run_ddpkit("train", *strategy, *WINE[:-1], "--resume", "--run-dir", str(run))
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("ddpkit: skipping checkpoint:")]
    assert len(skipped) == 1 and str(run / "checkpoints" / damaged) in skipped[0] and why in skipped[0], skipped
    assert "weights_only" not in skipped[0]
    assert f"resuming from {run / 'checkpoints' / 'epoch-000004'}" in proc.stdout
    assert_state_equal(load_model(run), load_model(reference))
