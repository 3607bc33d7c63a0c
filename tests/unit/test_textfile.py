"""Small text files written whole or not at all, also when writers race."""

import threading

from ddpkit.util.textfile import write_text_atomic


def test_racing_writers_leave_one_whole_file_and_no_temporary_ones(tmp_path):
    path = tmp_path / "progress"

    def writer(i):
        for j in range(200):
            write_text_atomic(path, f"{i} {j}\n" * 50)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = path.read_text().splitlines()
    assert len(lines) == 50 and len(set(lines)) == 1 and lines[0].split()[1] == "199"
    assert [p.name for p in tmp_path.iterdir()] == ["progress"]
