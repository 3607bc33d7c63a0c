"""The strategy's settings as flags: DDP or FSDP (and its replicas), the precision, the memory
the plan assumes, pretrained weights, activation checkpointing. The strategies read them as
the typed StrategyConfig (strategy_config.py, with their registry and rules), which
RunConfig.strategy_config() builds from these and the performance section."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DdpkitError
from ..parallel.dims import PP_SCHEDULES
from ..parallel.spec import STRATEGIES, strategy_help
from .settings import STRATEGY, Section, choice, setting

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Strategy(Section):
    """How the model is parallelised and in which precision: the flags of the StrategyConfig."""

    GROUP = STRATEGY

    strategy: str = setting(
        "ddp",
        strategy_help(),  # the registered strategies' lines (strategy_config.py)
        group=STRATEGY,
        choices=STRATEGIES,  # read when asked: a strategy registered later is offered too
    )
    replicate: int | None = setting(
        None,
        "--strategy fsdp or hsdp: R replicas, each sharded over world size / R processes (must divide it; "
        "HSDP: only the replicas' gradient all-reduce crosses them)",
        group=STRATEGY,
        type=int,
        metavar="R",
        default_help="fsdp: 1; hsdp: one per node",
    )
    tp: int = setting(
        1,
        "tensor parallel over N processes of a node: each of the model's Linear layers split across them "
        "(the task's tp_plan, or a Hugging Face model's own); --strategy says what the data-parallel rest does "
        "(world = data-parallel x pp x tp)",
        group=STRATEGY,
        type=int,
        metavar="N",
    )
    pp: int = setting(
        1,
        "pipeline parallel over N stages: the model's blocks cut into N consecutive parts, each on its own "
        "processes (world = data-parallel x pp x tp)",
        group=STRATEGY,
        type=int,
        metavar="N",
    )
    pp_schedule: str = setting(
        "1f1b",
        "--pp's schedule of micro-batches through the stages: gpipe (all forwards, then all backwards), 1f1b "
        "(one forward, one backward: fewer activations held), interleaved-1f1b (several stages per process)",
        group=STRATEGY,
        choices=PP_SCHEDULES,
    )
    pp_microbatches: int | None = setting(
        None,
        "--pp: micro-batches each step's share is cut into on its way through the pipeline (more: a smaller "
        "bubble, smaller matmuls)",
        group=STRATEGY,
        type=int,
        metavar="M",
        default_help="the number of stages",
    )
    precision: str = setting(
        "fp32",
        "bf16: autocast (DDP) or bf16 compute with fp32 weights (FSDP); needs a GPU or CPU with "
        "bf16; fp16: autocast with a gradient scaler (DDP on a GPU)",
        group=STRATEGY,
        choices=PRECISIONS,
    )
    device_memory: int | None = setting(
        None,
        "memory per device for the plan and --strategy auto: 80GiB (2^30 bytes), 80GB (10^9), 512MB",
        group=STRATEGY,
        type=str,
        metavar="SIZE",
        default_help="detected",
    )
    init_from: str | None = setting(
        None,
        "start from pretrained weights: a safetensors file, a Hugging Face folder (model.safetensors or its "
        "sharded index) or a torch state dict; each process reads only the part it keeps",
        group=STRATEGY,
        type=str,
        metavar="PATH",
        default_help="the task's init_from, else none",
    )
    activation_checkpointing: bool = setting(
        False,
        "keep only each block's input through the forward and recompute the rest in backward: less "
        "activation memory for ~one more forward; per block (the FSDP units, or Task.checkpoint_blocks), "
        "under ddp and fsdp alike, same results",
        group=STRATEGY,
    )

    def check(self) -> None:
        choice("--precision", self.precision, PRECISIONS)
        if self.device_memory is not None and (not isinstance(self.device_memory, int) or self.device_memory < 1):
            raise DdpkitError(f"--device-memory must be a positive size such as 80GiB, got {self.device_memory!r}")
