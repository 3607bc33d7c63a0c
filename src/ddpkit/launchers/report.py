"""What the launcher says about its workers, true for what ran: a line at each restart (which
rank failed and how, attempt N of M, what the restarted workers do), and the one line that ends
a failed job: a hang (the rank that hung, not the one that waited), a worker's refusal, an
abort in the teardown after a script had finished, a rank's exit code or signal, a lost
rendezvous. The workers leave what they know in their attempt's error folder (envvars.py)."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import DdpkitError, RunDirTaken, WorkerFailed
from ..training.oom import OOM_FILE
from ..util.envvars import RESTARTED_FILE, RETURNED_FILE, STACKS_FILE, attempt_errors, ranks_with

# what restarted workers do, by what they run
RESUME_TRAIN = "they resume from the newest checkpoint"
FROM_START = "they start again from the beginning"  # a function, the checks, a benchmark
RESUME_SCRIPT = (
    "the script starts again from its beginning (it continues where it stopped only if it loads its own checkpoint)"
)


def job_failure(e: Any, errors: Path, attempt: int, hang_dir: Path | None, since: float) -> DdpkitError | None:
    """The error that ends the job after torch's ChildFailedError `e` in restart attempt `attempt`
    (the hang summary is printed first), or None when every worker of this node had finished its
    script and the failures came in the teardown after it (said in a warning: the job's work is
    done). `errors`: the launch's error folder."""
    folder = attempt_errors(errors, attempt)
    hung = _hang_report(hang_dir, since, attempt) if hang_dir is not None else None
    if hung is not None:
        summary, line = hung
        print(summary, file=sys.stderr, flush=True)
        return WorkerFailed(line)
    hang_lines = sorted(folder.glob("hang-*.txt"))
    if hang_lines:  # a rank's watchdog ended the job, but no report is readable here
        return WorkerFailed(hang_lines[0].read_text().strip())
    oom = out_of_memory(folder, first_cause(e.failures)[0])
    if oom:  # a few lines from the rank that ran out of memory (training/oom.py): exit 1
        return WorkerFailed(oom)
    refusal = user_error(folder)
    if refusal:  # a worker refused the user's input (ddpkit train, launch's NCCL check): exit 2
        return (RunDirTaken if refusal.startswith(RunDirTaken.OPENING) else DdpkitError)(refusal)
    teardown = after_return(e.failures, folder)
    if teardown is not None:
        line, unfinished = teardown
        if not unfinished:
            print(
                f"ddpkit: warning: {line}; every worker's script had returned, so the job counts as done",
                file=sys.stderr,
                flush=True,
            )
            return None
        return WorkerFailed(f"{line}; rank(s) {', '.join(map(str, unfinished))} had not finished and were stopped")
    return WorkerFailed(failure_message(e, folder))


def user_error(folder: Path) -> str | None:
    """The first rank's one-line refusal, as the workers of `ddpkit train` write it (worker.py)."""
    user_errors = sorted(folder.glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1]))
    return user_errors[0].read_text().strip() if user_errors else None


def out_of_memory(folder: Path, first: int | None = None) -> str | None:
    """The message of the rank that ran out of memory (rank `first`, the first failure, when it did;
    else the lowest), naming the other ranks that ran out too; None when none did."""
    said = {rank: folder / OOM_FILE.format(rank=rank) for rank in ranks_with(folder, OOM_FILE)}
    if not said:
        return None
    rank = first if first in said else min(said)
    lines = said[rank].read_text().strip().splitlines() or [f"rank {rank} ran out of memory"]
    others = sorted(set(said) - {rank})
    if others:
        lines.insert(1, f"  rank(s) {', '.join(map(str, others))} ran out of memory too")
    return "\n".join(lines)


# deaths that are no rank's reaction to another's: killed from outside (the OOM killer, a user,
# the scheduler) or crashed; a lost peer makes a rank exit with an error or abort (SIGABRT), and
# torch's agent stops the others with SIGTERM, with SIGKILL only 30 s later
_KILLED_OR_CRASHED = {-int(s) for s in (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)}
_SAME_POLL_S = 5


def first_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """(rank, failure) to name among torch's ProcessFailures: the earliest (as torch's
    get_first_failure; on a tie the first recorded), unless a rank was killed or crashed within a
    few seconds of it: then that rank, whose death the other's error (its lost connection) was."""
    rank, first = min(failures.items(), key=lambda kv: kv[1].timestamp)
    for other, failure in sorted(failures.items()):
        if failure.exitcode in _KILLED_OR_CRASHED and failure.timestamp <= first.timestamp + _SAME_POLL_S:
            return other, failure
    return rank, first


def failure_message(e: Any, folder: Path) -> str:
    rank, failure = first_cause(e.failures)
    peer_losses = {int(p.stem.split("-")[1]): p for p in folder.glob("peer-*.txt")}
    if rank in peer_losses:
        # a lost connection is what another rank's death does to this one: when a worker of this
        # node failed on its own (an exit code, not a lost peer nor the agent's stop), name it,
        # whichever the agent saw first (both can end within one of its polls)
        cause = [r for r, f in sorted(e.failures.items()) if r not in peer_losses and f.exitcode > 0]
        if cause:
            rank, failure = cause[0], e.failures[cause[0]]
    if rank in peer_losses:
        # the first failure was a lost connection: the rank that died first is elsewhere
        return (
            peer_losses[rank].read_text().strip() + "; a process or node elsewhere in the job died "
            "(see that node's log); this node's workers were stopped"
        )
    raised = folder / f"raised-{rank}.txt"
    if raised.is_file():  # a worker of `ddpkit train` whose task raised (however it then ended): its exception
        said = raised.read_text().strip()
        return f"worker rank {rank} raised {said}; the other workers were stopped (its traceback is above)"
    return f"worker rank {rank} {how_it_ended(failure.exitcode)}; the other workers were stopped (see its output above)"


def how_it_ended(exitcode: int) -> str:
    return f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"


def after_return(failures: dict[int, Any], folder: Path) -> tuple[str, list[int]] | None:
    """(the line naming them, this node's ranks whose script had not returned) when the failures
    came after a script returned (a launch's bootstrap says so): some failed rank had returned,
    and every other failed rank ended by the agent's stop of the group (SIGTERM, SIGKILL after
    it); None otherwise."""
    returned = ranks_with(folder, RETURNED_FILE)
    after = {rank: f for rank, f in failures.items() if rank in returned}
    stopped = {-signal.SIGTERM, -signal.SIGKILL}
    if not after or any(f.exitcode not in stopped for rank, f in failures.items() if rank not in returned):
        return None
    parts = []
    for rank, failure in sorted(after.items()):
        code = failure.exitcode
        if code < 0:
            verb = "aborted" if -code == signal.SIGABRT else "crashed"
            parts.append(f"rank {rank} {verb} in torch's shutdown after the script finished (signal {-code})")
        else:
            parts.append(f"rank {rank} exited with code {code} in the shutdown after the script finished")
    local = ranks_with(folder, STACKS_FILE)  # every worker of this node leaves one when it starts
    return "; ".join(parts), sorted(local - returned)


def _hang_report(hang_dir: Path, since: float, attempt: int) -> tuple[str, str] | None:
    """(the summary, the line naming the rank that hung) of the hang report that attempt `attempt`
    of this launch wrote; None when there is none: no report, one of an earlier launch (older
    than `since`), or one of an earlier attempt, restarted since (the last one failed otherwise)."""
    from ..runtime.hang_summary import format_summary, hang_line
    from ..runtime.watchdog import ATTEMPT_FILE

    try:
        if (hang_dir / "request").stat().st_mtime < since - 1:
            return None
    except OSError:
        return None
    try:
        hung = int((hang_dir / ATTEMPT_FILE).read_text())
    except (OSError, ValueError):
        hung = None  # not recorded: print it
    if hung is not None and hung != attempt:
        return None
    summary = hang_dir / "summary.txt"
    text = summary.read_text().rstrip() if summary.exists() else format_summary(hang_dir)
    ranks = [int(line.split()[1]) for line in text.splitlines() if line.startswith("  rank ")]
    return text, hang_line(hang_dir, max(ranks) + 1 if ranks else None)


@dataclass
class RestartLine:
    """What the launcher says when torch's agent restarts this node's workers."""

    wording: str  # what the restarted workers do (RESUME_TRAIN, RESUME_SCRIPT)
    errors: Path  # the launch's error folder

    def failed(self, failures: dict[int, Any], restarts_done: int, max_restarts: int) -> str:
        rank, failure = first_cause(failures)
        folder = attempt_errors(self.errors, restarts_done - 1)
        why = user_error(folder) or (out_of_memory(folder, rank) or "").split("\n")[0]
        how = how_it_ended(failure.exitcode) + (f" ({why[:200]})" if why else "")
        return (
            f"ddpkit: worker rank {rank} {how}; restarting the workers, attempt {restarts_done + 1} "
            f"of {max_restarts + 1}: {self.wording}"
        )

    def joined(self) -> str:
        return (
            "ddpkit: another node is joining the job: restarting this node's workers in the new world "
            f"(not counted in --max-restarts): {self.wording}"
        )


@contextlib.contextmanager
def restarts_announced(line: RestartLine) -> Iterator[None]:
    """torch's agent restarts workers silently (it logs at INFO, which ddpkit keeps quiet without
    --verbose): for the launch, the agent torch's launcher creates is one that says so first."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.launcher import api

    torch_agent = api.LocalElasticAgent

    class Agent(torch_agent):  # type: ignore[misc, valid-type]
        _ddpkit_last: Any = None

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            self._ddpkit_last = result
            return result

        def _restart_workers(self, worker_group: Any) -> None:
            result, spec = self._ddpkit_last, worker_group.spec
            if result is not None and result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
                done = spec.max_restarts - self._remaining_restarts
                print(line.failed(result.failures, done, spec.max_restarts), file=sys.stderr, flush=True)
            elif result is not None and result.state == WorkerState.HEALTHY:
                print(line.joined(), file=sys.stderr, flush=True)
            if result is not None:
                mark_restart(line.errors, spec.max_restarts - self._remaining_restarts)
            super()._restart_workers(worker_group)

    api.LocalElasticAgent = Agent
    try:
        yield
    finally:
        api.LocalElasticAgent = torch_agent


def mark_restart(errors: Path, attempt: int) -> None:
    """As torch's agent restarts the workers: the failure's time, for the new attempt's ledger
    (training/ledger.py: the restart's seconds and the work lost)."""
    with contextlib.suppress(OSError):
        folder = attempt_errors(errors, attempt)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RESTARTED_FILE).write_text(repr(time.time()))


def rendezvous_message(e: BaseException, plan: Any, endpoint: str) -> str:
    """One line for a rendezvous that did not complete, naming the endpoint and what to check."""
    nodes = plan.nnodes if plan.min_nodes == plan.max_nodes else f"{plan.min_nodes} to {plan.max_nodes}"
    detail = str(e).strip().splitlines()[0][:160] if str(e).strip() else "closed"
    if type(e).__name__ == "RendezvousTimeoutError":
        what = "timed out"
    elif "timed out" in detail.lower():
        what = f"timed out ({detail})"
    else:
        what = f"failed ({type(e).__name__}: {detail})"
    if plan.rdzv_backend == "static":
        kind, same = (
            "static rendezvous",
            (
                f"--nnodes {plan.nnodes}, the same --master-addr and --master-port, its own "
                f"--node-rank; this is node {plan.node_rank}"
            ),
        )
    else:
        kind, same = "rendezvous", f"--nnodes {plan.nnodes}, the same --rdzv-endpoint and --rdzv-id {plan.rdzv_id}"
    return (
        f"{kind} at {endpoint} {what}: {nodes} node(s) were expected within --timeout {plan.timeout:g} s. "
        f"Check that every node runs the same command ({same}), that {endpoint} is reachable from every node "
        "(firewall, address), and that the other launchers have started"
    )
