"""A checkpoint is trained from only when it is what was written, and nothing it holds runs code:
CRC-32 checks of one-file checkpoints (torch's zip records) and of every file of a sharded one
(the header's list), DCP's `.metadata` through an allow-list, its shards' items as plain data.
(The attacks as another local user, at --resume and export: tests/distributed/test_integrity.py.)"""

import os
import pickle
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ddpkit import DdpkitError
from ddpkit.checkpoint import file as ck
from ddpkit.checkpoint.dcp_io import ChecksumWriter, load_into, load_metadata
from ddpkit.checkpoint.integrity import DamagedCheckpoint, crc32_of, verify_files

SRC = Path(__file__).resolve().parents[3] / "src"


class RunsCode:
    """Unpickling this runs a command: what a crafted file holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _data_offset(path: Path, record_suffix: str) -> int:
    """Where the bytes of the record named ...`record_suffix` start in a torch.save zip."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(record_suffix))
    head = path.read_bytes()[info.header_offset : info.header_offset + 30]
    name_len, extra_len = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


def test_a_flipped_bit_in_a_tensor_of_a_one_file_checkpoint_is_found_and_named(tmp_path):
    path = ck.atomic_save({"w": torch.arange(1000, dtype=torch.float32)}, tmp_path / "epoch-000001.pt")
    assert torch.equal(ck.load_file(path)["w"], torch.arange(1000, dtype=torch.float32))
    _flip(path, _data_offset(path, "data/0") + 123)
    assert torch.load(path, weights_only=True)["w"].sum() != torch.arange(1000.0).sum()  # torch loads it silently
    with pytest.raises(DamagedCheckpoint, match=r"epoch-000001\.pt: damaged: .*data/0 fails its CRC-32 check"):
        ck.load_file(path)


def test_a_cut_short_or_random_file_is_named_for_what_it_is(tmp_path):
    path = ck.atomic_save({"w": torch.ones(100)}, tmp_path / "a.pt")
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DamagedCheckpoint, match=r"a\.pt: damaged: truncated"):
        ck.load_file(path)
    garbage = tmp_path / "b.pt"
    garbage.write_bytes(b"\x00garbage\xff" * 500)
    with pytest.raises(DdpkitError, match=r"b\.pt: not a torch checkpoint file") as e:
        ck.load_file(garbage)
    assert "weights_only" not in str(e.value) and "Re-running" not in str(e.value)


def test_a_crafted_file_is_refused_with_what_it_names_not_torchs_advice_to_load_it_unrestricted(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": RunsCode(tmp_path / "ran")}, path)
    with pytest.raises(DdpkitError, match="refused to load") as e:
        ck.load_file(path)
    assert "system" in str(e.value) and "weights_only" not in str(e.value) and "Re-running" not in str(e.value)
    assert not (tmp_path / "ran").exists()


def test_the_checksums_are_kept_even_where_torch_was_told_not_to_write_them(tmp_path):
    from torch.serialization import get_crc32_options, set_crc32_options

    set_crc32_options(False)
    try:
        path = ck.atomic_save({"w": torch.ones(10)}, tmp_path / "x.pt")
        assert not get_crc32_options()  # put back as it was
    finally:
        set_crc32_options(True)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None and all(i.CRC for i in z.infolist() if i.file_size)


def test_the_writer_records_size_and_crc32_of_every_dcp_file_as_written(tmp_path):
    state = {"w": torch.randn(64, 8), "b": torch.randn(8), "lr": 0.1, "betas": (0.9, 0.99)}
    writer = ChecksumWriter(tmp_path / "ck", sync_files=True)
    dcp.save(state, storage_writer=writer, no_dist=True)
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert sorted(writer.sums) == files and ".metadata" in files  # every file, .metadata under its final name
    for name, sums in writer.sums.items():
        assert crc32_of(tmp_path / "ck" / name) == sums
    verify_files(tmp_path / "ck", writer.sums)
    loaded = {"w": torch.zeros(64, 8), "b": torch.zeros(8), "lr": None, "betas": None}
    load_into(loaded, tmp_path / "ck", no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["lr"] == 0.1 and tuple(loaded["betas"]) == (0.9, 0.99)

    shard = next(name for name in files if name.endswith(".distcp"))
    size = writer.sums[shard][0]
    _flip(tmp_path / "ck" / shard, size // 2)
    with pytest.raises(DamagedCheckpoint, match=rf"{shard}: damaged: it fails its CRC-32 check"):
        verify_files(tmp_path / "ck", writer.sums)
    os.truncate(tmp_path / "ck" / shard, size - 10)
    with pytest.raises(DamagedCheckpoint, match=rf"{shard}: truncated: {size - 10:,} bytes, written with {size:,}"):
        verify_files(tmp_path / "ck", writer.sums)
    (tmp_path / "ck" / shard).unlink()
    with pytest.raises(DamagedCheckpoint, match=rf"{shard}: missing"):
        verify_files(tmp_path / "ck", writer.sums)


def test_crafted_dcp_metadata_is_refused_before_anything_in_it_runs(tmp_path):
    folder = tmp_path / "ck"
    dcp.save({"w": torch.ones(4)}, storage_writer=ChecksumWriter(folder), no_dist=True)
    real = load_metadata(folder / ".metadata")
    assert list(real.state_dict_metadata) == ["w"]
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(tmp_path / "ran")))
    with pytest.raises(DdpkitError, match=r"\.metadata: refused to load: posix\.system is not part of a checkpoint"):
        load_metadata(folder / ".metadata")
    with pytest.raises(DdpkitError, match="refused to load"):
        load_into({"w": torch.zeros(4)}, folder, no_dist=True)
    assert not (tmp_path / "ran").exists()
    # a shard named outside the folder is refused too (DCP would read any file the job can)
    real.storage_data = {k: type(v)("../../etc/passwd", 0, 10) for k, v in real.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(real))
    with pytest.raises(DdpkitError, match="not a file of this folder"):
        load_metadata(folder / ".metadata")


def test_a_shards_non_tensor_item_that_would_run_code_is_refused(tmp_path):
    folder = tmp_path / "ck"
    state = {"w": torch.ones(4), "extra": RunsCode(tmp_path / "ran")}
    dcp.save(state, storage_writer=ChecksumWriter(folder), no_dist=True)
    with pytest.raises(DdpkitError, match="refused to load extra: it is not plain data"):
        load_into({"w": torch.zeros(4), "extra": None}, folder, no_dist=True)
    assert not (tmp_path / "ran").exists()


def test_src_unpickles_nothing_without_an_allow_list():
    """The rule the project keeps: no plain pickle.load(s), no weights_only=False, no DCP
    metadata read by torch's own reader (a plain pickle.load) anywhere in src/, comments included."""
    pattern = re.compile(r"weights_only\s*=\s*False|pickle\.loads?\(|\.read_metadata\(")
    found = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
    grep = ["git", "grep", "-n", "-I", "-E", pattern.pattern, "--", "src/*"]
    assert subprocess.run(grep, cwd=SRC.parent, capture_output=True, text=True).stdout == ""


def test_pretrained_weights_crafted_to_run_code_are_refused_without_torchs_advice(tmp_path):
    from ddpkit.checkpoint.pretrained import open_pretrained

    path = tmp_path / "weights.pt"
    torch.save({"w": RunsCode(tmp_path / "ran")}, path)
    with pytest.raises(DdpkitError, match="weights.pt: .*not plain data") as e:
        open_pretrained(str(path), [])
    assert "system" in str(e.value) and "weights_only" not in str(e.value) and "safe_globals" not in str(e.value)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    "text",
    [  # torch's wordings across versions: the refusal, then advice to load the file unrestricted or allow-list it
        "Weights only load failed. This file can still be loaded, to do so you have two options, do those steps "
        "only if you trust the source of the checkpoint.\n\t(1) In PyTorch 2.6, we changed the default value of "
        "`weights_only`. Re-running `torch.load` with `weights_only` set to `False` will likely succeed.\n\t(2) "
        "Alternatively, to load with `weights_only=True` please check the recommended steps in the following "
        "error message.\n\tWeightsUnpickler error: Unsupported global: GLOBAL posix.system was not an allowed "
        "global by default. Please use `torch.serialization.add_safe_globals([system])` to allowlist it.",
        "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will likely "
        "succeed.\n\nTrying to load unsupported GLOBAL posix.system whose module posix is blocked.\n\nCheck the "
        "documentation of torch.load to learn more about types accepted by default with weights_only",
    ],
)
def test_what_torch_refused_is_kept_and_its_advice_to_load_anyway_is_not(text):
    said = ck.not_plain_data(pickle.UnpicklingError(text))
    assert "posix.system" in said and "not plain data" in said
    assert not any(w in said for w in ("weights_only", "Re-running", "safe_globals", "allowlist", "trust"))


def _sharded_save(tmp_path):
    """A sharded folder as ddpkit writes it (one process): DCP's files and ddpkit.pt's header."""
    from torch import nn

    from ddpkit.checkpoint.sharded import save_state_dir
    from ddpkit.environments import DistEnv
    from ddpkit.runtime import Runtime

    torch.manual_seed(0)
    with Runtime(DistEnv(), device="cpu", threads=1) as rt:
        save_state_dir(tmp_path / "d", nn.Linear(4, 2), None, {"note": "x"}, rt)
    return tmp_path / "d", torch.load(tmp_path / "d" / "ddpkit.pt", weights_only=True)


def test_a_sharded_header_claiming_checksums_is_never_trusted_by_size_alone(tmp_path, capsys):
    from ddpkit.checkpoint.sharded import FILES, check_files

    folder, meta = _sharded_save(tmp_path)
    shards = {p.name for p in folder.iterdir()} - {"ddpkit.pt"}
    assert set(meta[FILES]) == shards and meta["layout"] == 2  # every file listed, and the header says so
    shard = next(name for name in shards if name.endswith(".distcp"))
    _flip(folder / shard, meta[FILES][shard][0] - 8)  # a bit of a tensor: the size stays
    for stripped in ({k: v for k, v in meta.items() if k != FILES}, {**meta, FILES: {}}, {**meta, FILES: None}):
        with pytest.raises(DamagedCheckpoint, match="lists no size and CRC-32 for"):
            check_files(folder, stripped)
    partial = {**meta, FILES: {k: v for k, v in meta[FILES].items() if k != shard}}
    with pytest.raises(DamagedCheckpoint, match=f"lists no size and CRC-32 for {shard}"):
        check_files(folder, partial)
    # written before ddpkit kept checksums (no layout, no list): read, checked by size, with one warning
    old = {k: v for k, v in meta.items() if k not in (FILES, "layout")}
    capsys.readouterr()
    check_files(folder, old)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "checked by size only" in err and str(folder) in err
