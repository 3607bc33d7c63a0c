"""ddpkit.notebook_launch from a real Jupyter kernel (nbclient): examples/notebook.ipynb trains
on 2 processes (an own loop and a ddpkit.Task) with every rank's lines in the notebook; a
test-made notebook shows a worker's exception raised in the kernel naming the rank, the kernel
still launching afterwards, and the refusal of a kernel whose CPU thread pool has started."""

import json
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


WAITS = """
def waits(busy):  # rank 1 fails while rank 0 waits for it in a collective (the normal case), or computes
    import time
    import torch
    rt = ddpkit.init()
    if rt.rank == 1:
        time.sleep(1)  # rank 0 is inside the all-reduce by then
        raise ValueError("bad batch on rank 1 (sample 7)")
    if busy:
        time.sleep(60)  # still computing when torch's agent stops it (its SIGTERM: a SignalException here)
    torch.distributed.all_reduce(torch.ones(3))
"""

FAILING_TASK = """
import torch
from torch.utils.data import TensorDataset

def loss(out, y):  # rank 1 raises at its first step; rank 0 goes on into the gradients' all-reduce
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch on rank 1 (sample 7)")
    return torch.nn.functional.mse_loss(out, y)

g = torch.Generator().manual_seed(0)
task = ddpkit.Task(
    model=torch.nn.Linear(4, 1),
    train_set=TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    loss_fn=loss,
)
ddpkit.notebook_launch(task, nproc=2, epochs=1, batch_size=8, quiet=True)
"""

MADE = [
    "import os\nimport ddpkit",
    'def boom():\n    if os.environ["RANK"] == "1":\n        raise ValueError("bad batch on this rank")\n    return 0',
    "ddpkit.notebook_launch(boom, nproc=2)",
    'ddpkit.notebook_launch(lambda base: base + int(os.environ["RANK"]), 41, nproc=2)',
    WAITS + "ddpkit.notebook_launch(waits, False, nproc=2)",
    "ddpkit.notebook_launch(waits, True, nproc=2)",
    FAILING_TASK,
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
    # rank 0 inside a collective when rank 1 raises: rank 1 is named, and rank 0 says nothing of
    # the stop that followed (no SignalException, no traceback of its own)
    for cell in cells[4:6]:
        assert errors(cell) == [("DdpkitError", "rank 1 raised ValueError: bad batch on rank 1 (sample 7)")]
        assert "[rank1]:ValueError: bad batch on rank 1 (sample 7)" in text(cell, "stderr")
        assert "SignalException" not in text(cell, "stderr") and "[rank0]:Traceback" not in text(cell, "stderr")
    # a Task that raises on rank 1: its exception and message, not only an exit code
    assert errors(cells[6]) == [
        (
            "WorkerFailed",
            "worker rank 1 raised ValueError: bad batch on rank 1 (sample 7); the other workers were stopped "
            "(its traceback is above)",
        )
    ]
    assert "SignalException" not in text(cells[6], "stderr")
    [run] = (tmp_path / "runs").glob("notebook-*")
    assert (
        json.loads((run / "failed.json").read_text())["error"] == "rank 1: ValueError: bad batch on rank 1 (sample 7)"
    )
    # a parallel torch op in the kernel started its thread pool: a forked worker would hang, so it is refused
    [(name, message)] = errors(cells[8])
    assert name == "DdpkitError" and "torch's CPU thread pool is running in this kernel" in message
