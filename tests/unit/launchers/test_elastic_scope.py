"""What the launcher changes in its own process for a launch (the workers' environment, torch's
log tail) holds for the launch only: put back after it, also when it fails, and without undoing
what others changed meanwhile."""

import os
import sys

import pytest
from torch.distributed.elastic.multiprocessing import tail_log

from ddpkit.errors import DdpkitError
from ddpkit.launchers.elastic import LaunchPlan, run_elastic
from ddpkit.launchers.scope import scoped_environ, tail_whole_lines, whole_line_tail


def test_scoped_environ_restores_its_keys_only(monkeypatch):
    monkeypatch.setenv("DDPKIT_T_KEPT", "old")
    monkeypatch.delenv("DDPKIT_T_NEW", raising=False)
    monkeypatch.delenv("DDPKIT_T_OTHERS", raising=False)
    with pytest.raises(RuntimeError):
        with scoped_environ({"DDPKIT_T_KEPT": "launch", "DDPKIT_T_NEW": "launch"}):
            assert os.environ["DDPKIT_T_KEPT"] == os.environ["DDPKIT_T_NEW"] == "launch"
            os.environ["DDPKIT_T_OTHERS"] = "set by another thread"
            raise RuntimeError("the launch failed")
    assert os.environ["DDPKIT_T_KEPT"] == "old" and "DDPKIT_T_NEW" not in os.environ
    assert os.environ.pop("DDPKIT_T_OTHERS") == "set by another thread"  # not wiped, as a clear() + update() would


def test_torchs_tail_is_back_after_the_launch_even_when_it_fails():
    torch_tail = tail_log.tail_logfile
    with pytest.raises(RuntimeError), whole_line_tail():
        assert tail_log.tail_logfile is tail_whole_lines
        raise RuntimeError
    assert tail_log.tail_logfile is torch_tail


def test_a_launch_refused_before_it_starts_leaves_the_process_as_it_was():
    before, torch_tail = dict(os.environ), tail_log.tail_logfile
    with pytest.raises(DdpkitError, match="--logs-specs"):
        run_elastic(
            LaunchPlan(nproc_per_node=2),
            sys.executable,
            ["-c", "pass"],
            env={"DDPKIT_T_WORKER": "1"},
            agent_options={"logs_specs": "no-such-logs-specs"},
        )
    assert dict(os.environ) == before and tail_log.tail_logfile is torch_tail


def test_a_launch_leaves_the_process_as_it_was(tmp_path):
    before, torch_tail = dict(os.environ), tail_log.tail_logfile
    out = tmp_path / "seen"
    code = f"import os; open(r'{out}' + os.environ['LOCAL_RANK'], 'w').write(os.environ['DDPKIT_T_WORKER'])"
    run_elastic(
        LaunchPlan(nproc_per_node=2, timeout=60), sys.executable, ["-c", code], env={"DDPKIT_T_WORKER": "given"}
    )
    assert [(tmp_path / f"seen{r}").read_text() for r in (0, 1)] == ["given", "given"]  # the workers had it
    assert dict(os.environ) == before and tail_log.tail_logfile is torch_tail  # this process has it no more


def _signal_handlers_seen() -> dict[str, str]:
    import signal

    def name(handler: object) -> str:
        if handler is signal.SIG_DFL:
            return "default"
        if handler is signal.default_int_handler:
            return "KeyboardInterrupt"
        return getattr(handler, "__qualname__", repr(handler))

    return {sig: name(signal.getsignal(getattr(signal, sig))) for sig in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")}


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_worker_starts_with_a_new_processs_signal_handlers_however_it_was_started(start_method):
    """torch's agent sets handlers that raise its SignalException before it starts the workers, and
    a forked worker inherits them: its SIGTERM from the agent (another rank failed) then raised in
    whatever ran, e.g. a weakref callback, whose 'Exception ignored in' traceback reached the
    user's terminal beside the one-line error. A worker starts as a spawned one does: SIGTERM ends
    it, Ctrl-C raises KeyboardInterrupt."""
    plan = LaunchPlan(nproc_per_node=2, start_method=start_method, timeout=60)
    results = run_elastic(plan, _signal_handlers_seen, [])
    expected = {"SIGTERM": "default", "SIGINT": "KeyboardInterrupt", "SIGHUP": "default", "SIGQUIT": "default"}
    assert results == {0: expected, 1: expected}
