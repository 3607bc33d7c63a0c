import re
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import DdpkitError, Task
from ddpkit.strategies.optimizers import make_optimizer
from ddpkit.task import as_task, build_task, load_task_function


def test_wine_task_is_the_guides_workload():
    task = build_task("wine")
    assert len(task.train_set) == 142 and len(task.eval_set) == 36
    x, y = task.train_set.tensors
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape[1] == 13
    # the scaler was fit on the training split only: its columns are standardised exactly
    torch.testing.assert_close(x.mean(0), torch.zeros(13), atol=1e-5, rtol=0)
    assert [type(m) for m in task.model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert (task.model[0].in_features, task.model[0].out_features, task.model[2].out_features) == (13, 64, 3)
    opt = make_optimizer(task.optimizer, task.model, None)
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == 1e-3
    assert make_optimizer(task.optimizer, task.model, 0.5).param_groups[0]["lr"] == 0.5


def test_task_from_a_file_path(tmp_path):
    f = tmp_path / "mytask.py"
    f.write_text(
        textwrap.dedent("""
        import torch
        def build():
            m = torch.nn.Linear(2, 2)
            ds = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
            return ds, m, torch.optim.SGD(m.parameters(), lr=0.1)
    """)
    )
    task = build_task(f"{f}:build")
    assert isinstance(task, Task) and len(task.train_set) == 4


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("nosuch", "unknown task"),
        ("no_such_module_xyz:build", "not found"),
        ("json:no_such_function", "has no function"),
        ("/does/not/exist.py:build", "does not exist"),
    ],
)
def test_bad_task_names(spec, fragment):
    with pytest.raises(DdpkitError, match=fragment):
        load_task_function(spec)


def test_a_task_file_that_does_not_parse_shows_where_and_loads_once_fixed(tmp_path):
    f = tmp_path / "typo.py"
    f.write_text("def build(:\n    pass\n")
    with pytest.raises(DdpkitError) as e:
        load_task_function(f"{f}:build")
    first, *rest = str(e.value).splitlines()
    assert first.startswith(f"task file '{f}' failed at import: SyntaxError: ")
    assert rest[:2] == [f'  File "{f}", line 1', "    def build(:"] and rest[2].strip() == "^"
    f.write_text("def build():\n    return 7\n")  # the half-imported module was not kept
    assert load_task_function(f"{f}:build")() == 7


def _parts():
    m = nn.Linear(2, 2)
    return m, TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda m, ds: 42, "returned int"),
        (lambda m, ds: {"model": m}, "without"),
        (lambda m, ds: {"model": m, "train_set": ds, "optimizer": None, "bogus": 1}, "unknown keys"),
        (lambda m, ds: {"model": "m", "train_set": ds, "optimizer": lambda p: None}, "must be a torch.nn.Module"),
        (lambda m, ds: {"model": m, "train_set": 5, "optimizer": lambda p: None}, "map-style"),
        (lambda m, ds: {"model": m, "train_set": [], "optimizer": lambda p: None}, "empty"),
        (lambda m, ds: {"model": m, "train_set": ds, "optimizer": 3}, "optimizer must be"),
    ],
)
def test_wrong_return_values_are_explained(make, fragment):
    with pytest.raises(DdpkitError, match=fragment):
        as_task(make(*_parts()))


def test_optimizer_of_another_model_is_refused():
    m, ds = _parts()
    task = as_task({"model": m, "train_set": ds, "optimizer": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)})
    with pytest.raises(DdpkitError, match="does not optimise"):
        make_optimizer(task.optimizer, m, None)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("subprocess:run", "subprocess.run, a function of Python's own library"),
        ("shutil:rmtree", "shutil.rmtree, a function of Python's own library"),
        ("os:system", "posix.system, a builtin_function_or_method, not a Python function"),
        ("subprocess:Popen", "a type, not a Python function"),
    ],
)
def test_a_spec_naming_what_is_not_a_task_is_refused_before_it_is_called(tmp_path, spec, fragment):
    from ddpkit.config.file import read_config_file

    marker = tmp_path / "ran"
    config = tmp_path / "evil.toml"
    config.write_text(f'task = "{spec}"\n[task_args]\nargs = ["touch", "{marker}"]\n')
    with pytest.raises(DdpkitError, match=re.escape(fragment)):
        load_task_function(read_config_file(config)["task"])
    assert not marker.exists()
