"""Cluster fixtures (need root; run with `-m cluster`).

two_nodes: cluster.netns.Network with nodes node1/node2 (namespaces ddpknn-n1/-n2,
           10.213.50.11/.12, interface eth0; bridge ddpknn-br at 10.213.50.1).
           The namespaces live for the whole session; after each test every process
           still running in them is SIGKILLed.
slurm:     cluster.slurm.SlurmCluster: munged + slurmctld + slurmd node1/node2, each
           node in its own network/UTS/mount namespace (10.213.77.11/.12), started once
           per session on first use. After each test, jobs it left are cancelled.
Both are always torn down (namespaces, bridge, daemons) at the end of the session.
"""

import contextlib
import signal
import threading

import pytest

from .netns import require_root
from .netns import two_nodes as _make_two_nodes
from .slurm import require_slurm, slurm_cluster


@contextlib.contextmanager
def _sigterm_runs_teardown():
    """SIGTERM (e.g. a CI timeout) normally kills pytest without any teardown; turn it
    into KeyboardInterrupt so the namespaces and daemons are still removed."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(scope="session")
def two_nodes_session():
    require_root()
    with _sigterm_runs_teardown(), _make_two_nodes("ddpknn", subnet="10.213.50") as net:
        yield net


@pytest.fixture
def two_nodes(two_nodes_session):
    try:
        yield two_nodes_session
    finally:
        two_nodes_session.kill_all()


@pytest.fixture(scope="session")
def slurm_session(tmp_path_factory):
    require_slurm()
    workdir = tmp_path_factory.mktemp("slurm")
    with _sigterm_runs_teardown(), slurm_cluster(workdir, prefix="ddpksl", subnet="10.213.77") as cluster:
        yield cluster


@pytest.fixture
def slurm(slurm_session):
    try:
        yield slurm_session
    finally:
        slurm_session.cancel_all()
