"""Where am I on a SkyPilot cluster. SkyPilot runs a task's `run` commands once per node, with
SKYPILOT_NODE_RANK (this node's index), SKYPILOT_NODE_IPS (every node's address, one a line,
node 0's first), SKYPILOT_NUM_NODES and SKYPILOT_NUM_GPUS_PER_NODE. It places nodes, not
workers: `ddpkit train` (or `ddpkit launch`) on each node starts that node's workers itself, and
reads these variables as the defaults of its flags (`launcher_defaults`): --nnodes, --node-rank,
--master-addr (node 0) and --nproc (the node's GPUs, or 1); with a job token (DDPKIT_JOB_TOKEN,
one of the task's `secrets`, which `ddpkit sky` writes for several nodes) --rdzv-endpoint on
node 0's address instead, the c10d rendezvous the token seals. So the task's `run` line is the same
on every node, with no per-node variable in it (what `ddpkit sky` writes, engines/skypilot.py).

A script started alone (`python train.py`) where these name several nodes or GPUs would train
one silent copy per node; `check_alone` refuses that. Reads variables only.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import DdpkitError
from ..util.jobtoken import has_job_token
from .base import DEFAULT_PORT, Environ, Environment, env_int

NODE_RANK = "SKYPILOT_NODE_RANK"
NODE_IPS = "SKYPILOT_NODE_IPS"
NUM_NODES = "SKYPILOT_NUM_NODES"
GPUS_PER_NODE = "SKYPILOT_NUM_GPUS_PER_NODE"
VARIABLES = (NODE_RANK, NODE_IPS, NUM_NODES, GPUS_PER_NODE)


class SkyPilot(Environment):
    """A node of a SkyPilot task: ddpkit starts its workers, from SkyPilot's description of the job."""

    name = "skypilot"
    starter = "SkyPilot"
    # SkyPilot started this node's command, never a worker: detect() is never true, so DistEnv
    # never reads this; `ddpkit env` names SkyPilot as the launcher found by it
    outside_launcher = True

    def detect(self, e: Environ) -> bool:
        return False  # the workers are ddpkit's own (torchrun's variables then place them)

    def fields(self, e: Environ) -> dict[str, Any]:
        raise AssertionError("SkyPilot places no worker: detect() is never true")

    def present(self, e: Environ) -> bool:
        return NODE_RANK in e

    def feeds_launcher(self, e: Environ) -> bool:
        return self.present(e)

    def launcher_defaults(self, e: Environ) -> dict[str, str]:
        """The node flags' defaults; none where the variables do not add up (every command's flags
        are made from them: `ddpkit env` says what is wrong, see warnings())."""
        try:
            return node_defaults(e) if self.present(e) else {}
        except DdpkitError:
            return {}

    def check_alone(self, e: Environ) -> None:
        if not self.present(e):
            return
        node = node_defaults(e)
        if int(node["nnodes"]) > 1 or int(node["nproc"]) > 1:
            raise DdpkitError(
                f"this SkyPilot task runs on {node['nnodes']} node(s) x {node['nproc']} GPU(s) "
                f"({NUM_NODES} / {GPUS_PER_NODE}), but the script was started alone: start it with "
                "`ddpkit launch SCRIPT.py` (or `ddpkit train`), which reads SkyPilot's variables"
            )

    def title(self, report: Mapping[str, Any]) -> str:
        return "SkyPilot node (ddpkit starts this node's workers; SKYPILOT_* give the nodes)"

    def details(self, e: Environ) -> dict[str, Any]:
        return {"skypilot": {k: e[k] for k in VARIABLES if k in e}} if self.present(e) else {}

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        sky = report.get("skypilot")
        if not sky:
            return []
        shown = " ".join(f"{k}={' '.join(v.split())}" for k, v in sky.items())
        return [f"  skypilot    {shown} (read by ddpkit launch / train as their node flags)"]

    def allocated_nodes(self, e: Environ) -> int | None:
        return int(self.launcher_defaults(e).get("nnodes", 0)) or None

    def warnings(self, report: Mapping[str, Any], cores: int) -> list[str]:
        try:
            node_defaults(report.get("skypilot") or {})
        except DdpkitError as e:
            return [str(e)] if report.get("skypilot") else []
        return []

    def master_of(self, report: Mapping[str, Any]) -> tuple[str, str] | None:
        ips = (report.get("skypilot") or {}).get(NODE_IPS, "").split()
        return (ips[0], f"the first of {NODE_IPS}") if ips else None


def node_defaults(e: Environ) -> dict[str, str]:
    """{RunConfig field: text} for this node of a SkyPilot task: the defaults of the node flags."""
    ips = e.get(NODE_IPS, "").split()
    rank = _int(e, NODE_RANK)
    nodes = _int(e, NUM_NODES, default=len(ips) or 1)
    if nodes < 1 or not 0 <= rank < nodes:
        raise DdpkitError(f"inconsistent SkyPilot environment: {NODE_RANK}={rank} {NUM_NODES}={nodes}")
    if nodes > 1 and len(ips) != nodes:
        raise DdpkitError(
            f"{NUM_NODES}={nodes} but {NODE_IPS} names {len(ips)} address(es): node 0's address is not known; "
            "run the command from the task's `run` section, where SkyPilot sets both"
        )
    out = {"nnodes": str(nodes), "node_rank": str(rank), "nproc": str(_gpus(e))}
    if nodes > 1 and has_job_token(e):
        # a job token seals c10d's store only (the static rendezvous cannot be sealed, and is refused
        # with one): node 0's address is the endpoint, node 0 hosts it, the rendezvous assigns node ranks
        out.pop("node_rank")
        out["rdzv_endpoint"] = f"{ips[0]}:{DEFAULT_PORT}"
    elif nodes > 1:
        out["master_addr"] = ips[0]
    return out


def _gpus(e: Environ) -> int:
    """Workers on this node: one per GPU, or one on a node without GPUs (a fraction of a GPU: one)."""
    raw = e.get(GPUS_PER_NODE, "0") or "0"
    try:
        return max(1, int(float(raw)))
    except ValueError:
        raise DdpkitError(f"{GPUS_PER_NODE}={raw!r} is not a number") from None


def _int(e: Environ, name: str, default: int | None = None) -> int:
    return env_int(e, name, default, empty_is_unset=True)
