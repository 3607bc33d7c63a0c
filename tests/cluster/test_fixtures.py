"""The cluster fixtures work with real components: torchrun across two network
namespaces (static and c10d rendezvous) and real 2-node SLURM jobs (srun, requeue,
signals). Run: python3 -m pytest tests/cluster -m cluster -q  (as root)."""

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

PY = sys.executable  # the python running the tests (it has torch, in CI the .venv one)

ALLREDUCE_TORCHRUN = textwrap.dedent("""\
    import datetime, json, os, socket, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "sum": t.item(),
                   "group_rank": int(os.environ["GROUP_RANK"]),
                   "local_rank": int(os.environ["LOCAL_RANK"]),
                   "master_addr": os.environ["MASTER_ADDR"]}, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # avoids the rare gloo abort at interpreter exit
""")

ALLREDUCE_SLURM = textwrap.dedent("""\
    import datetime, os, socket, sys
    import torch, torch.distributed as dist
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    host = socket.gethostname()
    print(f"rank={rank} world={world} host={host} ip={socket.gethostbyname(host)} "
          f"sum={t.item()}", flush=True)
    dist.destroy_process_group()
    os._exit(0)
""")

WORKER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _check_ranks(out: Path, world: int, results) -> list[dict]:
    logs = "\n".join(map(str, results))
    for r in results:
        assert not r.timed_out and r.returncode == 0, logs
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == list(range(world)), logs
    for r in ranks:
        assert r["world"] == world
        assert r["sum"] == world * (world - 1) / 2  # 0 + 1 + 2 + 3
    return ranks


def test_netns_basics(two_nodes):
    """Own address, lo up, TCP across the bridge, private hostname + /etc/hosts."""
    n1, n2 = two_nodes.nodes
    assert n1.ip != n2.ip and n1.netns != n2.netns
    assert two_nodes.bridge_ip.startswith(two_nodes.subnet)
    r = n1.run(["ip", "-o", "-4", "addr", "show"], timeout=10, check=True)
    assert f"{n1.ifname}    inet {n1.ip}/24" in r.stdout and "lo    inet 127.0.0.1" in r.stdout
    assert "default" not in n1.run(["ip", "route"], timeout=10, check=True).stdout
    port = two_nodes.next_port()
    server = n1.popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""\
        import socket
        s = socket.socket(); s.bind(("{n1.ip}", {port})); s.listen(); s.settimeout(20)
        print("listening", flush=True); c, a = s.accept(); print(c.recv(16).decode(), a[0])"""),
        ],
        stdout=-1,
        text=True,
    )
    assert server.stdout.readline().strip() == "listening"
    n2.run(
        [
            sys.executable,
            "-c",
            f"import socket; socket.create_connection(('{n1.ip}', {port}), timeout=10).send(b'hello')",
        ],
        timeout=20,
        check=True,
    )
    out, _ = server.communicate(timeout=20)
    assert out.split() == ["hello", n2.ip]
    r = n2.run(
        [
            sys.executable,
            "-c",
            "import socket; h = socket.gethostname(); print(h, socket.gethostbyname(h), socket.gethostbyname('node1'))",
        ],
        timeout=20,
        uts=True,
        check=True,
    )
    assert r.stdout.split() == ["node2", n2.ip, n1.ip]
    assert n1.env()["GLOO_SOCKET_IFNAME"] == n1.ifname


def _torchrun(node, rdzv_args, script, out):
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.5",
        *rdzv_args,
        str(script),
        str(out),
    ]


def test_torchrun_static_two_nodes(two_nodes, tmp_path):
    n1, n2 = two_nodes.nodes
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_TORCHRUN)
    port = two_nodes.next_port()
    cmds = [
        (
            n,
            _torchrun(
                n,
                ["--node-rank", str(i), "--master-addr", n1.ip, "--master-port", str(port), "--rdzv-backend", "static"],
                script,
                tmp_path,
            ),
        )
        for i, n in enumerate((n1, n2))
    ]
    results = two_nodes.run_all(cmds, timeout=120, env=WORKER_ENV, log_dir=tmp_path / "logs")
    ranks = _check_ranks(tmp_path, 4, results)
    assert {r["master_addr"] for r in ranks} == {n1.ip}
    assert sorted((r["group_rank"], r["local_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_torchrun_c10d_two_nodes(two_nodes, tmp_path):
    n1, n2 = two_nodes.nodes
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_TORCHRUN)
    port = two_nodes.next_port()
    cmds = [
        (
            n,
            _torchrun(
                n,
                [
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"{n1.ip}:{port}",
                    "--rdzv-id",
                    "fixture-test",
                    "--rdzv-conf",
                    f"is_host={int(n is n1)}",
                    "--local-addr",
                    n.ip,
                ],
                script,
                tmp_path,
            ),
        )
        for n in (n1, n2)
    ]
    results = two_nodes.run_all(cmds, timeout=120, env=WORKER_ENV, log_dir=tmp_path / "logs")
    ranks = _check_ranks(tmp_path, 4, results)
    assert {r["master_addr"] for r in ranks} <= {n1.ip, n2.ip}


def test_slurm_two_node_allreduce(slurm, tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_SLURM)
    job_file = tmp_path / "job.sbatch"
    job_file.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=1
        #SBATCH --time=00:02:00
        #SBATCH --output={tmp_path}/job-%j.out
        set -euo pipefail
        export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
        export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
        echo "batch on $(hostname) nodes=$SLURM_JOB_NODELIST master=$MASTER_ADDR"
        srun --kill-on-bad-exit=1 {PY} {script}
        """)
    )
    job = slurm.submit(job_file, cwd=tmp_path, env=WORKER_ENV)
    res = slurm.wait(job, timeout=90)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert res.ok, f"{res}\n{out}\n{slurm.diagnostics(job)}"
    assert res.exit_code == 0 and res.node_list == "node[1-2]"
    lines = sorted(line for line in out.splitlines() if line.startswith("rank="))
    assert len(lines) == 2, out
    hosts = set()
    for rank, line in enumerate(lines):
        fields = dict(kv.split("=") for kv in line.split())
        assert fields["rank"] == str(rank) and fields["world"] == "2", out
        assert float(fields["sum"]) == 3.0, out
        node = slurm.net.node(fields["host"])
        assert fields["ip"] == node.ip, out  # each rank on its own node's address
        hosts.add(fields["host"])
    assert hosts == {"node1", "node2"}, out
    assert "master=node1" in out


def test_slurm_requeue_followed_to_completion(slurm, tmp_path):
    marker = tmp_path / "marker"
    job = slurm.submit_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=1
        #SBATCH --requeue
        #SBATCH --open-mode=append
        #SBATCH --time=00:02:00
        #SBATCH --output={tmp_path}/requeue-%j.out
        echo "run restart_count=${{SLURM_RESTART_COUNT:-unset}} on $(hostname)"
        if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
            scontrol requeue "$SLURM_JOB_ID"
            sleep 60
            echo "first run was not stopped by the requeue"
            exit 3
        fi
        echo done > {marker}
        """),
        cwd=tmp_path,
        name="requeue",
    )
    res = slurm.wait(job, timeout=60)
    out = (tmp_path / f"requeue-{job}.out").read_text()
    assert res.ok, f"{res}\n{out}\n{slurm.diagnostics(job)}"
    assert res.restarts == 1, res
    assert marker.read_text().strip() == "done"
    assert "restart_count=unset" in out and "restart_count=1" in out, out
    assert "not stopped" not in out, out


def test_slurm_signal_batch_step(slurm, tmp_path):
    ready, got = tmp_path / "ready", tmp_path / "got"
    job = slurm.submit_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=1
        #SBATCH --time=00:02:00
        #SBATCH --output={tmp_path}/signal-%j.out
        trap 'echo USR1 > {got}; exit 0' USR1
        touch {ready}
        sleep 60 & wait
        exit 4
        """),
        cwd=tmp_path,
        name="signal",
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, slurm.diagnostics(job)
        time.sleep(0.1)
    slurm.signal(job, "USR1", scope="batch")
    res = slurm.wait(job, timeout=30)
    assert res.ok, f"{res}\n{slurm.diagnostics(job)}"
    assert got.read_text().strip() == "USR1"
