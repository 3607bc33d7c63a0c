"""The job's device mesh, described without torch: which rank does what on each named dim.

Every rank of a job sits at one point of a mesh of four named dims, outermost first:
`pp` (pipeline stages, across nodes), `dp_replicate` (HSDP's replicas, or DDP's ranks),
`dp_shard` (FSDP's shards) and `tp` (the tensor-parallel group, innermost: consecutive ranks,
so within a node). world = pp x dp_replicate x dp_shard x tp.

One object answers what every part of a run must agree on: the batch plan and the sampler
take the data-parallel degree and this rank's index on it (the ranks of one tp group, and the
stages of one pipeline, see the same samples); the loss and the evaluation count a sample on
one rank of each tp group and the last stage only; clip_grad_norm reduces over every dim in
use; the strategies build their sub-meshes from `names` and `shape` (strategies/mesh.py holds
the torch side). A new parallelism adds its dim here and asks this object, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DdpkitError

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first: the order of the mesh's dims
DP_DIMS = ("dp_replicate", "dp_shard")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the four dims and this rank's place on them (see the module docstring)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for name in DIMS:
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise DdpkitError(f"the mesh's {name} degree must be a positive number, got {size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a mesh of {self.world_size} ranks")

    @classmethod
    def of(
        cls, world_size: int, *, tp: int = 1, pp: int = 1, replicate: int | None = None, shards: bool, rank: int = 0
    ) -> ParallelDims:
        """The mesh of `world_size` ranks: `tp` x `pp` of them per data-parallel rank (refused
        unless they divide the world); the rest data-parallel, `replicate` replicas of sharded
        state when the strategy `shards` (FSDP, HSDP), one replica per rank when it does not (DDP)."""
        check_degrees(world_size, tp, pp)
        dp = world_size // (tp * pp)
        if not shards:
            return cls(dp_replicate=dp, dp_shard=1, tp=tp, pp=pp, rank=rank)
        r = replicate or 1
        if dp % r:
            raise DdpkitError(
                f"--replicate {r} does not divide the {dp} data-parallel ranks (world {world_size} / tp {tp} / "
                f"pp {pp}) into equal replicas: choose a divisor of them"
            )
        return cls(dp_replicate=r, dp_shard=dp // r, tp=tp, pp=pp, rank=rank)

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many different shares of each global batch are trained
        at once (the batch plan's and the sampler's world)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes of the dims in use (`names`), outermost first: what init_device_mesh takes."""
        return tuple(getattr(self, n) for n in self.names)

    @property
    def names(self) -> tuple[str, ...]:
        """The dims of more than one rank, outermost first; `dp_shard` alone when every dim is 1
        (one process), so that the mesh always has a dim to name."""
        used = tuple(n for n in DIMS if getattr(self, n) > 1)
        return used or ("dp_shard",)

    @property
    def dp_names(self) -> tuple[str, ...]:
        """The data-parallel dims in use: what FSDP shards over (and HSDP replicates over), what
        the gradients are averaged over."""
        used = tuple(n for n in DP_DIMS if getattr(self, n) > 1)
        return used or ("dp_shard",)

    @property
    def grad_norm_names(self) -> tuple[str, ...]:
        """The dims clip_grad_norm's total norm reduces over: every dim in use (sharded and
        tensor-parallel gradients are parts of one norm; pipeline stages hold different layers)."""
        return self.names

    # -- this rank's place ----------------------------------------------------------------------
    def coordinate(self, name: str) -> int:
        """This rank's index on dim `name` (ranks are numbered with `tp` fastest)."""
        if name not in DIMS:
            raise ValueError(f"no dim {name!r} in {DIMS}")
        stride = 1
        for n in reversed(DIMS):
            size = getattr(self, n)
            if n == name:
                return (self.rank // stride) % size
            stride *= size
        raise AssertionError("unreachable")

    @property
    def tp_rank(self) -> int:
        return self.coordinate("tp")

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: which share of each global batch it
        trains (the same for every rank of its tp group and every stage of its pipeline)."""
        return self.coordinate("dp_replicate") * self.dp_shard + self.coordinate("dp_shard")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def counts_samples(self) -> bool:
        """Whether this rank's loss and evaluation sums enter the job's totals: one rank per
        data-parallel share (tp rank 0 of the last stage), since the others compute the same
        loss (tp) or none (earlier stages)."""
        return self.tp_rank == 0 and self.is_last_stage

    def describe(self) -> str:
        """The mesh in one line, for the summary and rank 0's note."""
        parts = [f"{n} {getattr(self, n)}" for n in DIMS if getattr(self, n) > 1]
        return " x ".join(parts) if parts else "one process"


def check_degrees(world_size: int | None, tp: int, pp: int, local_world_size: int | None = None) -> None:
    """Refuse a tp or pp degree that the processes cannot form: each a positive number, tp x pp
    dividing the world (world = dp x pp x tp) and tp dividing one node's processes (a tp group
    exchanges activations in every layer: it stays within a node)."""
    for flag, n in (("--tp", tp), ("--pp", pp)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise DdpkitError(f"{flag} must be a positive number of processes, got {n!r}")
    if local_world_size is not None and local_world_size % tp:
        raise DdpkitError(
            f"--tp {tp} does not divide the {local_world_size} processes of a node: a tensor-parallel group stays "
            f"within one node; choose a --tp that divides --nproc {local_world_size}"
        )
    if world_size is not None and world_size % (tp * pp):
        raise DdpkitError(
            f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the {world_size} processes (world = data-parallel x "
            f"pp x tp): choose degrees whose product divides {world_size}"
        )
