"""Streams on one process: the readers provided (tar, jsonl, lines), the deal of shards, and
the progress display without a length."""

import io
import tarfile

import pytest
import torch

from ddpkit import DdpkitError, ShardedStream, read_jsonl, read_lines, read_tar
from ddpkit.data.streams import Reader, StreamLoader, my_shards
from ddpkit.reporting.progress import Progress


def test_a_webdataset_tar_groups_files_by_key_into_samples(tmp_path):
    path = tmp_path / "shard-000.tar"
    with tarfile.open(path, "w") as tar:
        for key, label in (("000001", b"3"), ("000002", b"7")):
            for ext, data in (("txt", f"sample {key}".encode()), ("cls", label)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    samples = list(read_tar(str(path)))
    assert samples == [
        {"__key__": "000001", "txt": b"sample 000001", "cls": b"3"},
        {"__key__": "000002", "txt": b"sample 000002", "cls": b"7"},
    ]
    stream = ShardedStream([str(path)], decode=lambda s: (torch.tensor(int(s["cls"])),))
    assert [t[0].item() for t in stream] == [3, 7]


def test_jsonl_and_text_shards_and_a_broken_line_named(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"v": 1}\n\n{"v": 2}\n')
    (tmp_path / "b.txt").write_text("one\ntwo\n")
    assert list(read_jsonl(str(tmp_path / "a.jsonl"))) == [{"v": 1}, {"v": 2}]
    assert list(read_lines(str(tmp_path / "b.txt"))) == ["one", "two"]
    (tmp_path / "c.jsonl").write_text('{"v": 1}\nnot json\n')
    with pytest.raises(DdpkitError, match=r"c.jsonl:2: not JSON"):
        list(read_jsonl(str(tmp_path / "c.jsonl")))
    with pytest.raises(DdpkitError, match="no reader for"):
        ShardedStream([str(tmp_path / "d.parquet")])
    with pytest.raises(DdpkitError, match="the shard list is empty"):
        ShardedStream([])


def test_every_shard_goes_to_one_reader_and_a_resume_at_another_world_size_skips_finished_ones():
    for world, workers in ((1, 1), (2, 1), (3, 2), (4, 3)):
        got = sorted(
            s
            for r in range(world)
            for w in range(workers)
            for s in my_shards(10, 3, 1, True, Reader(r, world, w, workers), {}, True)
        )
        assert got == list(range(10)), (world, workers)
    done = {0: None, 4: None, 7: 5}  # two shards finished, one half read
    got = [s for r in range(3) for s in my_shards(10, 3, 1, True, Reader(r, 3), done, same_deal=False)]
    assert sorted(got) == [1, 2, 3, 5, 6, 7, 8, 9]


def test_a_stream_loader_alone_takes_every_sample_once():
    class Numbers(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.arange(10).unsqueeze(1))

    loader = StreamLoader(Numbers(), batch_size=3)
    steps = list(loader.iter_steps())
    assert [n for _, n, _ in steps] == [3, 3, 3, 1] and torch.cat([b for b, _, _ in steps]).flatten().tolist() == list(
        range(10)
    )
    assert loader.state()["items"] == {0: 10}


def test_progress_lines_of_a_stream_show_samples_and_rate_without_a_total(capsys, monkeypatch):
    monkeypatch.setenv("DDPKIT_PROGRESS_INTERVAL", "0")
    p = Progress("lines", None, 0, None)
    p.start_epoch(0)
    p.step(4, 8, torch.tensor([2.0, 4.0]))
    p.end_epoch({"epoch": 1, "train_loss": 0.5, "samples_per_s": 100.0})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("epoch 1  8 samples  rank0_loss 0.5000  samples/s ") and "eta" not in out[0]
    assert out[1].startswith("epoch 1  train_loss 0.5000") and "eta" not in out[1]
