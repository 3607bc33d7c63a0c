"""Where the other nodes are: a static rendezvous (--master-addr, --node-rank) or c10d
(--rdzv-endpoint), with torchrun's flags and spellings; one node by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import DdpkitError
from .settings import NODES, Section, setting

RDZV_BACKENDS = ("c10d", "static")


@dataclass(frozen=True)
class Nodes(Section):
    """The nodes of the job and how they meet (run the same command on every node)."""

    GROUP = NODES

    # where the other nodes are (torchrun's flags); one node by default
    nnodes: str = setting("1", "number of nodes, or MIN:MAX for an elastic job with --rdzv-endpoint", group=NODES)
    standalone: bool = setting(
        False, "one node, rendezvous on a free local port (torchrun's --standalone; ddpkit's default)", group=NODES
    )
    node_rank: int | None = setting(
        None,
        "this node's index, 0 on the master node (static rendezvous with --master-addr)",
        group=NODES,
        type=int,
        aliases=("--node_rank",),
    )
    master_addr: str | None = setting(
        None, "address of node 0 (static rendezvous)", group=NODES, type=str, aliases=("--master_addr",)
    )
    master_port: int | None = setting(
        None,
        "port on node 0 for the static rendezvous",
        group=NODES,
        type=int,
        default_help="29500",
        aliases=("--master_port",),
    )
    rdzv_backend: str | None = setting(
        None,
        "c10d or static; with torchrun's spellings, c10d + --master-addr meets at "
        "MASTER_ADDR:MASTER_PORT and static + --rdzv-endpoint at that endpoint",
        group=NODES,
        type=str,
        choices=RDZV_BACKENDS,
        aliases=("--rdzv_backend",),
        default_help="c10d with --rdzv-endpoint, static with --master-addr",
    )
    rdzv_conf: str = setting(
        "",
        "c10d rendezvous settings KEY=VALUE,... (is_host, join_timeout, last_call_timeout, "
        "close_timeout, keep_alive_interval, keep_alive_max_attempt, read_timeout)",
        group=NODES,
        aliases=("--rdzv_conf",),
        metavar="K=V,...",
    )
    rdzv_endpoint: str | None = setting(
        None,
        "c10d rendezvous: every node names the same HOST:PORT (hosted by the node that owns "
        "HOST); node ranks are assigned (a --node-rank is ignored, as torchrun does)",
        group=NODES,
        type=str,
        metavar="HOST:PORT",
        aliases=("--rdzv_endpoint",),
    )
    rdzv_id: str | None = setting(
        None,
        "job id shared by all nodes of a c10d rendezvous",
        group=NODES,
        type=str,
        default_help="derived from the endpoint",
        aliases=("--rdzv_id",),
    )
    local_addr: str | None = setting(
        None,
        "this node's address as the other nodes reach it",
        group=NODES,
        type=str,
        default_help="the address that routes to the master",
        aliases=("--local_addr",),
    )

    def _torchrun_spellings(self) -> None:
        """torchrun's ways of naming a rendezvous, as the ones ddpkit validates: --standalone
        is one node on a free port; c10d + --master-addr meets at MASTER_ADDR:MASTER_PORT;
        static + --rdzv-endpoint is that master; a --node-rank beside a c10d endpoint is
        ignored (the rendezvous assigns it), as torchrun ignores it."""

        def put(**kw: Any) -> None:
            for k, v in kw.items():
                object.__setattr__(self, k, v)

        if self.standalone:
            put(nnodes="1", rdzv_endpoint=None, master_addr=None, master_port=None, node_rank=None)
        if self.rdzv_backend == "c10d" and self.master_addr and not self.rdzv_endpoint:
            put(rdzv_endpoint=f"{self.master_addr}:{self.master_port or 29500}", master_addr=None, master_port=None)
        if self.rdzv_backend == "static" and self.rdzv_endpoint and not self.master_addr:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            put(
                master_addr=host or self.rdzv_endpoint,
                master_port=int(port) if port.isdigit() else None,
                rdzv_endpoint=None,
            )
        if self.rdzv_endpoint and self.node_rank is not None and not self.master_addr:
            put(node_rank=None)

    def rdzv_settings(self) -> dict[str, str]:
        """--rdzv-conf K=V,... as a dict (refused when malformed)."""
        out: dict[str, str] = {}
        for item in filter(None, (s.strip() for s in self.rdzv_conf.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise DdpkitError(f"--rdzv-conf must be KEY=VALUE,..., got {self.rdzv_conf!r}")
            out[key.strip()] = value.strip()
        return out

    @property
    def node_range(self) -> tuple[int, int]:
        lo, _, hi = self.nnodes.partition(":")
        return int(lo), int(hi or lo)

    @property
    def multi_node(self) -> bool:
        return self.node_range[1] > 1

    def check(self) -> None:
        try:
            lo, hi = self.node_range
        except ValueError:
            raise DdpkitError(f"--nnodes must be N or MIN:MAX, got {self.nnodes!r}") from None
        if lo < 1 or hi < lo:
            raise DdpkitError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {self.nnodes!r}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise DdpkitError(f"--master-port must be a TCP port (1-65535), got {self.master_port}")
        if self.rdzv_endpoint:
            if self.master_addr:
                raise DdpkitError("give either --rdzv-endpoint (c10d rendezvous) or --master-addr (static), not both")
            if self.node_rank is not None:
                raise DdpkitError(
                    "--node-rank is for a static rendezvous; with --rdzv-endpoint the rendezvous assigns node ranks: "
                    "drop --node-rank"
                )
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise DdpkitError(f"--rdzv-endpoint must be HOST:PORT, got {self.rdzv_endpoint!r}")
        elif self.multi_node:
            if lo != hi:
                raise DdpkitError("--nnodes MIN:MAX (elastic) needs a c10d rendezvous: give --rdzv-endpoint HOST:PORT")
            if not self.master_addr:
                raise DdpkitError(
                    f"--nnodes {self.nnodes} needs --master-addr (node 0's address) and --node-rank, "
                    "or --rdzv-endpoint HOST:PORT"
                )
            if self.node_rank is None:
                raise DdpkitError(
                    f"--nnodes {self.nnodes} with --master-addr needs --node-rank "
                    f"(0 on the master node, 1..{hi - 1} on the others)"
                )
        if self.node_rank is not None and not 0 <= self.node_rank < hi:
            raise DdpkitError(f"--node-rank must be in 0..{hi - 1} for --nnodes {self.nnodes}, got {self.node_rank}")
        self.rdzv_settings()  # refuses a malformed --rdzv-conf
