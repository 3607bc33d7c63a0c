"""The sealed store over a real TCPStore: what a client of the same port without the job token
sees (names and values that say nothing) and what it can still do (its forged or replayed
values refused where they would be used; counters, which cannot be sealed, taken as they are)."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpkit.errors import DdpkitError
from ddpkit.runtime.sealed import SealedStore, SealError
from ddpkit.util.jobtoken import ensure_token_file, job_token, read_token_file

KEY = b"k" * 32


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    yield store


def client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=5))


def test_keys_and_values_tell_an_outsider_nothing_and_forgeries_are_refused(server):
    job = SealedStore(client(server), KEY)
    job.set("torch.rendezvous.myjob", b"10.0.0.1:29400 state")
    job.multi_set(["rank_0", "rank_1"], [b"addr-0", b"addr-1"])
    assert job.get("torch.rendezvous.myjob") == b"10.0.0.1:29400 state"
    assert job.multi_get(["rank_0", "rank_1"]) == [b"addr-0", b"addr-1"]

    outsider = client(server)
    names = outsider.list_keys()
    assert len(names) == 3 and all(n.startswith("ddpkit-sealed/") for n in names), names
    assert not any(b"10.0.0.1" in outsider.get(n) or b"addr" in outsider.get(n) for n in names)
    assert not any("myjob" in n or "rank" in n for n in names)

    # a forged value, one copied from another key, one sealed with another key: none opens
    state = next(n for n in names if len(outsider.get(n)) == 32 + 20)  # the tag, then the 20 bytes
    rank_names = [n for n in names if n != state]
    outsider.set(state, b"\x80\x04crafted pickle")
    with pytest.raises(SealError, match="not written by a node with this job's token"):
        job.get("torch.rendezvous.myjob")
    outsider.set(rank_names[0], outsider.get(rank_names[1]))  # rank 1's address as rank 0's
    with pytest.raises(SealError):
        job.multi_get(["rank_0", "rank_1"])
    SealedStore(outsider, b"x" * 32).set("rank_1", b"attacker")
    with pytest.raises(SealError):
        job.get("rank_1")
    # other tokens, other names: two jobs on one store never meet
    assert len(outsider.list_keys()) == 4


def test_compare_set_wait_and_counters_behave_as_torchs_store(server):
    """What torch's rendezvous and agent use: compare_set against the value they read, wait, add."""
    job, other_node = SealedStore(client(server), KEY), SealedStore(client(server), KEY)
    assert job.compare_set("state", "", "sentinel") == b"sentinel"  # absent: set
    assert other_node.compare_set("state", "", "mine") == b"sentinel"  # present: kept, and returned
    assert other_node.compare_set("state", b"sentinel", b"v2") == b"v2"
    assert job.compare_set("state", b"sentinel", b"v3") == b"v2"  # stale expectation: not set
    job.set("ready", b"1")
    other_node.wait(["ready"])
    other_node.wait(["ready"], timedelta(seconds=1))
    assert other_node.check(["ready"]) and not other_node.check(["absent"])
    before = set(client(server).list_keys())
    assert job.add("count", 2) == 2 and other_node.add("count", 3) == 5
    (counter,) = set(client(server).list_keys()) - before
    client(server).add(counter, 10)  # a counter cannot be sealed: an outsider may bump it (README, Security)
    assert job.add("count", 0) == 15
    assert job.delete_key("ready") and not job.check(["ready"])
    job.set_timeout(timedelta(seconds=3))
    assert job.timeout == timedelta(seconds=3)


def test_the_token_file_is_made_private_and_refused_when_others_may_read_it(tmp_path, monkeypatch):
    path = ensure_token_file(tmp_path / "run")
    assert path.stat().st_mode & 0o777 == 0o600
    token = read_token_file(path)
    assert len(token) >= 40 and ensure_token_file(tmp_path / "run") == path and read_token_file(path) == token
    monkeypatch.setenv("DDPKIT_JOB_TOKEN_FILE", str(path))
    assert job_token() is not None
    path.chmod(0o640)
    with pytest.raises(DdpkitError, match="may be read by others .mode 0640.: chmod 600"):
        job_token()
    monkeypatch.delenv("DDPKIT_JOB_TOKEN_FILE")
    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "short")
    with pytest.raises(DdpkitError, match="has 5 characters: use at least 16"):
        job_token()
    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "  ")
    assert job_token() is None


def test_the_plan_names_where_the_token_comes_from_and_a_static_rendezvous_is_refused_with_one():
    from conftest import run_ddpkit

    env = {"DDPKIT_JOB_TOKEN": "a" * 20}
    plan = run_ddpkit("train", "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400", env=env)
    assert "job token          from DDPKIT_JOB_TOKEN\n" in plan.stdout and "a" * 20 not in plan.stdout
    static = run_ddpkit(
        "train", "--dry-run", "--nnodes", "2", "--master-addr", "10.0.0.1", "--node-rank", "1", env=env, check=False
    )
    assert static.returncode == 2 and "use --rdzv-endpoint HOST:PORT on every node" in static.stderr, static.stderr
