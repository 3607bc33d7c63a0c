"""notebook_launch's refusals before anything is forked (the launches themselves run in a real
kernel: tests/distributed/test_notebook.py)."""

import pytest

from ddpkit.errors import DdpkitError
from ddpkit.run.notebook import notebook_launch


def test_a_setting_runconfig_lacks_is_named():
    with pytest.raises(DdpkitError, match="no setting epoch, lr_rate; the settings are RunConfig's"):
        notebook_launch(print, nproc=2, epoch=3, lr_rate=0.1)


def test_no_process_is_refused():
    with pytest.raises(DdpkitError, match="nproc=0: give 1 or more processes"):
        notebook_launch(print, nproc=0)


def test_what_is_neither_a_function_nor_a_task_is_refused():
    with pytest.raises(DdpkitError, match="takes a function or a ddpkit.Task, got int"):
        notebook_launch(3, nproc=2)
