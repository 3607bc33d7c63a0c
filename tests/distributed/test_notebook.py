"""ddpkit.notebook_launch from a real Jupyter kernel (nbclient): examples/notebook.ipynb trains
on 2 processes (an own loop and a ddpkit.Task) with every rank's lines in the notebook; a
test-made notebook shows a worker's exception raised in the kernel naming the rank, the kernel
still launching afterwards, and the refusal of a kernel whose CPU thread pool has started."""

import re

import nbclient  # the test extra installs nbclient, nbformat and ipykernel
import nbformat
import pytest

from conftest import REPO

EXAMPLE = REPO / "examples" / "notebook.ipynb"


def execute(nb, where, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO / "src"))  # the kernel imports this checkout's ddpkit
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(where)}}
    ).execute()
    return nb


def text(cell, stream="stdout"):
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == stream)


def errors(cell):
    return [(o["ename"], o["evalue"]) for o in cell.outputs if o["output_type"] == "error"]


@pytest.mark.slow
def test_the_example_notebook_trains_on_2_processes_with_every_ranks_lines(tmp_path, monkeypatch):
    nb = nbformat.read(EXAMPLE, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit the notebook without outputs"
    execute(nb, tmp_path, monkeypatch)
    assert [errors(c) for c in code] == [[]] * len(code)
    own_loop, task = text(code[2]), text(code[3])
    losses = {r: re.search(rf"\[rank{r}\]:epoch 3: global loss (\S+)", own_loop).group(1) for r in (0, 1)}
    assert losses[0] == losses[1]  # the global mean, the same on both ranks
    assert f"rank 0 returned {losses[0]}" in own_loop
    assert "[rank0]:epoch 3/3  train_loss" in task and "world size 2, eval accuracy" in task
    runs = list((tmp_path / "runs").glob("notebook-*"))
    assert len(runs) == 1 and (runs[0] / "model.pt").is_file()


MADE = [
    "import os\nimport ddpkit",
    'def boom():\n    if os.environ["RANK"] == "1":\n        raise ValueError("bad batch on this rank")\n    return 0',
    "ddpkit.notebook_launch(boom, nproc=2)",
    'ddpkit.notebook_launch(lambda base: base + int(os.environ["RANK"]), 41, nproc=2)',
    "import torch\ntorch.set_num_threads(2)\ntorch.ones(1 << 20).mul_(2).sum().item()",
    "ddpkit.notebook_launch(lambda: 1, nproc=2)",
]


@pytest.mark.slow
def test_a_workers_exception_is_raised_in_the_kernel_naming_the_rank(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in MADE])
    cells = execute(nb, tmp_path, monkeypatch).cells
    assert errors(cells[2]) == [("DdpkitError", "rank 1 raised ValueError: bad batch on this rank")]
    assert "[rank1]:ValueError: bad batch on this rank" in text(cells[2], "stderr")  # its traceback, prefixed
    # the kernel launches again, and rank 0's value comes back
    assert errors(cells[3]) == [] and cells[3].outputs[-1]["data"]["text/plain"] == "41"
    # a parallel torch op in the kernel started its thread pool: a forked worker would hang, so it is refused
    [(name, message)] = errors(cells[5])
    assert name == "DdpkitError" and "torch's CPU thread pool is running in this kernel" in message
