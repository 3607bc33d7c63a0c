"""Another local user (uid 65534, by setpriv) attacks a job run as root: a crafted checkpoint
folder planted where the run's checkpoints are, snapshot folders planted in /dev/shm, the
loopback stores of a one-node job. Nothing the attacker wrote runs (the payload would create a
marker file) and the job ends as it should."""

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_state_equal, load_model, run_ddpkit

ATTACKER = str(Path(__file__).parent / "scripts" / "local_attacker.py")
PACED = str(Path(__file__).parent / "scripts" / "paced_wine.py") + ":build"
WINE = ("--nproc", "2", "--seed", "5", "--save-every", "2", "--epochs", "6", "--quiet")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


class RunsCode:
    """Unpickling this runs a shell command as whoever unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"id -u > {self.marker}",))


@pytest.fixture
def shared():
    """A folder every local user may write (a team's shared scratch space), removed afterwards."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the attacker as another user (uid 65534)")
    folder = Path(tempfile.mkdtemp(prefix="ddpkit-shared-", dir="/tmp"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def as_nobody(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, *cmd], capture_output=True, text=True, timeout=120, **kw)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO / "src")}


def test_a_planted_checkpoint_folder_with_crafted_metadata_runs_nothing_at_resume_or_export(shared, reference_run):
    run = shared / "run"
    shutil.copytree(reference_run(*WINE), run)  # a finished DDP run in a folder others may write
    (run / "checkpoints").chmod(0o777)
    marker = shared / "ran"
    # what the attacker brings: a sharded folder whose ddpkit.pt is a real header (an older
    # ddpkit's: no checksums) and whose .metadata runs a command when unpickled
    kit = shared / "kit"
    kit.mkdir()
    header = torch.load(run / "checkpoints" / "epoch-000006.pt", weights_only=True)
    header.update(format="ddpkit-sharded-checkpoint", epoch=99)
    for key in ("model", "optimizer"):
        header.pop(key)
    torch.save(header, kit / "ddpkit.pt")
    (kit / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    (kit / "__0_0.distcp").write_bytes(b"")
    kit.chmod(0o755)
    planted = as_nobody("cp", "-r", str(kit), str(run / "checkpoints" / "epoch-000099"))
    assert planted.returncode == 0, planted.stderr
    assert (run / "checkpoints" / "epoch-000099").stat().st_uid == 65534

    resumed = run_ddpkit("train", *WINE[:-3], "--epochs", "8", "--resume", "--run-dir", str(run), "--quiet")
    skipped = [line for line in resumed.stdout.splitlines() if line.startswith("ddpkit: skipping checkpoint:")]
    assert len(skipped) == 1 and "epoch-000099/.metadata: refused to load: posix.system" in skipped[0], skipped
    exported = run_ddpkit("export", str(run), "--checkpoint", "epoch-000099", "--out", str(shared / "out"), check=False)
    assert exported.returncode == 2 and "refused to load: posix.system" in exported.stderr, exported.stderr
    assert not marker.exists()
    assert not (shared / "out").exists()


def test_planted_snapshot_folders_are_never_read_and_a_jobs_own_are_private(shared, reference_run):
    """ddpkit's launcher gives its workers a folder nobody can predict; one named after the job
    and the agent (torchrun's workers) that another user made first is refused in one line."""
    marker = shared / "ran"
    evil = shared / "snapshot.pt"
    torch.save({"model": RunsCode(marker)}, evil)
    evil.chmod(0o644)
    # the names an older ddpkit used, for every agent process id that may come next
    base = os.getpid()
    names = [f"/dev/shm/ddpkit-snapshots-known-{pid}" for pid in range(base, base + 400)]
    script = "; ".join(
        f"mkdir -p {n} && echo '3 1.0' > {n}/progress && cp {evil} {n}/snapshot-0000000099.pt" for n in names
    )
    try:
        assert as_nobody("sh", "-c", script).returncode == 0
        run = shared / "run"
        proc = run_ddpkit(
            "train",
            *WINE[:-1],
            "--max-restarts",
            "1",
            "--snapshot-every-steps",
            "1",
            "--rdzv-id",
            "known",
            "--run-dir",
            str(run),
        )
        assert "resuming from" not in proc.stdout and not marker.exists()
        assert_state_equal(load_model(run), load_model(reference_run(*WINE)))

        # torchrun's workers find their folder by name: one planted there is refused, the run goes on
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
        torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "known"]
        train = ["-m", "ddpkit", "train", *WINE[2:-1], "--snapshot-every-steps", "1", "--run-dir", str(shared / "t")]
        job = subprocess.Popen(
            [*torchrun, *train], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        name = f"/dev/shm/ddpkit-snapshots-known-{job.pid}"  # the agent is torchrun's own process
        names.append(name)
        as_nobody(
            "sh", "-c", f"mkdir -p {name} && echo '3 1.0' > {name}/progress && cp {evil} {name}/snapshot-0000000099.pt"
        )
        out, err = job.communicate(timeout=240)
        assert job.returncode == 0, err
        refused = [line for line in out.splitlines() if "is not this job's own" in line]
        assert refused and "owner uid 65534" in refused[0] and not marker.exists(), out
    finally:
        for n in names:
            shutil.rmtree(n, ignore_errors=True)


def test_the_snapshot_folder_ddpkit_makes_is_private(shared):
    from ddpkit.checkpoint.snapshot import SnapshotStore, new_agent_folder

    folder = new_agent_folder("job", root=shared)
    try:
        assert folder.stat().st_mode & 0o777 == 0o700 and folder.name.startswith(f"ddpkit-snapshots-job-{os.getpid()}-")
        store = SnapshotStore(folder)
        store.write(1, {"w": torch.ones(2)})
        store.wait()
        store.mark(1)
        assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()} == {
            "snapshot-0000000001.pt": 0o600,
            "progress": 0o600,
        }
        readers = as_nobody("ls", str(folder))
        assert readers.returncode != 0 and "Permission denied" in readers.stderr
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_another_local_user_cannot_reach_a_one_node_jobs_rendezvous_or_store(shared, reference_run):
    """In a network namespace of its own (only this job and its attacker on its loopback): the
    attacker scans for the job user's listening ports while the job trains, and overwrites the
    rendezvous state and every key of any c10d store it reaches."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip to give the job and its attacker a loopback of their own")
    marker, run = shared / "ran", shared / "run"
    attack = " ".join([*NOBODY, sys.executable, ATTACKER, str(marker), "known", "25", "0"])
    train = [sys.executable, "-m", "ddpkit", "train", PACED, *WINE[:-1], "--max-restarts", "1"]
    train += ["--rdzv-id", "known", "--run-dir", str(run)]
    script = (
        f"ip link set lo up && ({attack} > {shared}/attacker.out 2>&1 &) && sleep 4 && "
        f"{' '.join(train)} > {shared}/job.out 2>&1; echo $? > {shared}/job.rc; wait"
    )
    env = {**_env(), "PACED_WINE_STEP_S": "0.5"}
    subprocess.run(["unshare", "--net", "sh", "-c", script], env=env, timeout=300, check=True)
    time.sleep(0.5)
    deadline = time.monotonic() + 60
    while "stores reached" not in (shared / "attacker.out").read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    out = (shared / "attacker.out").read_text()
    assert (shared / "job.rc").read_text().strip() == "0", (shared / "job.out").read_text()
    assert "stores reached (port, keys): []" in out and "ports tried []" not in out, out  # it saw gloo's ports
    assert not marker.exists()
    assert_state_equal(load_model(run), load_model(reference_run(*WINE)))
