"""Pipeline parallel: the model cut into stages (pipeline_split.py), each pp rank holding its
stage(s), torch.distributed.pipelining's schedule running the micro-batches through them;
data parallel over the ranks of each stage (their gradients summed in one all-reduce).

The ranks form a (pp, dp) grid, pp outermost: rank = pp_index x dp + dp_index. The ranks of
one pipeline (one dp index) read the same batch: the first stage feeds the inputs, the last
scores the targets.

Exactness (the same model as at one process, within rounding):
  * every rank builds the whole model from the same seed (or materialises it from meta the
    same way) before cutting it: the weights do not depend on the mesh;
  * the schedule does not scale the gradients (scale_grads=False): each micro-batch's mean
    loss is weighted by its samples / the global batch, and the dp ranks of a stage sum their
    gradients after the schedule's last backward, so the gradient is the mean over the global
    batch, as at one process (micro-batches counted as accumulation, a short last batch too).
    Not torch's DDP: its reducer, driven by the schedule's backward of the last micro-batch
    only, counts each parameter twice by the second step and fails (torch 2.13);
  * the loss sums are the last stages' (the others add zeros), so the loop's sums over every
    rank are the global ones; the gradient norm is summed over the stages.
  * a batch of n samples runs as the largest count of equal micro-batches up to
    --pp-microbatches that divides n: torch's stages need every micro-batch of one shape.
    One set of stages per shape met (a short last batch, evaluation's last batch).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..checkpoint import state as ckpt_state
from ..checkpoint.file import model_signature
from ..data import eval_batches
from ..errors import DdpkitError
from ..runtime import Runtime
from ..util.tree import map_tensors
from .base import Strategy
from .materialize import fill
from .optimizers import OptimizerSpec, make_optimizer
from .pipeline_split import split_model

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def largest_divisor(n: int, at_most: int) -> int:
    """The most equal micro-batches (up to `at_most`) that `n` samples cut into."""
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


class StageHolder(nn.Module):
    """This rank's stages under one root, every module at its path in the whole model: what
    the optimizer steps and the checkpoints save (the whole model's FQNs, this rank's part)."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        for stage in stages:
            _merge_into(self, stage)


def _merge_into(target: nn.Module, source: nn.Module) -> None:
    for name, child in source.named_children():
        mine = getattr(target, name, None) if name in target._modules else None
        if mine is None:
            target.add_module(name, child)
        elif mine is not child:
            _merge_into(mine, child)
    for name, p in source.named_parameters(recurse=False):
        target.register_parameter(name, p)
    for name, b in source.named_buffers(recurse=False):
        target.register_buffer(name, b)


class PipelineStrategy(Strategy):
    """--pp N: the stages over the pp dim of a (pp, dp) grid, data parallel over dp."""

    name = "ddp"  # what the data-parallel ranks do
    checkpoint_kind = "sharded"  # each stage writes its part, under the whole model's names

    def __init__(
        self,
        rt: Runtime,
        config: Any = None,
        *,
        pp: int,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        blocks: Any = None,
        splits: Any = None,
        loss_fn: Callable | None = None,
    ) -> None:
        super().__init__(rt, config)
        if schedule not in SCHEDULES:
            raise DdpkitError(f"--pp-schedule {schedule}: choose one of {', '.join(SCHEDULES)}")
        self.pp, self.schedule_name, self.blocks, self.splits = pp, schedule, blocks, splits
        self.microbatches = microbatches or pp
        dims = rt.dims  # parallel/dims.py: pp outermost, rank = pp_rank x dp + dp_rank (no tp here)
        self.dp, self.pp_rank, self.dp_rank = dims.dp, dims.pp_rank, dims.dp_rank
        self.loss_fn = loss_fn or nn.CrossEntropyLoss()
        self.per_rank = 2 if schedule == "interleaved-1f1b" else 1
        self.n_stages = pp * self.per_rank
        self.stage_ids = [self.pp_rank + pp * v for v in range(self.per_rank)]
        self._pipes: dict[tuple[int, int], Any] = {}
        self._weight = 1.0

    # -- building -------------------------------------------------------------------
    def setup_module(self, model: nn.Module) -> nn.Module:
        self._groups()
        model = fill(model, self.rt.device, self.model_init(model))  # the whole model, the same on every rank
        self.full_names = list(model.state_dict().keys())
        stages = split_model(model, self.n_stages, self.blocks, self.splits)
        self.stages = [stages[i].to(self.rt.device) for i in self.stage_ids]
        holder = StageHolder(self.stages)
        holder.whole_signature = model_signature(model.state_dict())  # checkpoints name the whole model
        self._whole = model  # for the optimizer's groups over the whole model (setup_optimizer)
        return holder

    def _groups(self) -> None:
        """The pp group of this rank's pipeline and the dp group of its stage (every rank
        creates every group, as torch asks)."""
        rt, pp, dp = self.rt, self.pp, self.dp
        self.pp_group = self.dp_group = None
        if not dist.is_initialized():
            return
        for d in range(dp):
            ranks = [p * dp + d for p in range(pp)]
            group = dist.new_group(ranks)
            if rt.rank in ranks:
                self.pp_group = group
        for p in range(pp):
            ranks = [p * dp + d for d in range(dp)]
            group = dist.new_group(ranks)
            if rt.rank in ranks:
                self.dp_group = group

    def setup_optimizer(self, spec: OptimizerSpec, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        """The task's optimizer over this rank's stages; the checkpoints count the whole model's groups."""
        whole = make_optimizer(spec, self._whole, lr)
        model.whole_groups = [len(g["params"]) for g in whole.param_groups]
        names = {id(p): n for n, p in self._whole.named_parameters()}
        model.whole_group_names = [[names[id(p)] for p in g["params"]] for g in whole.param_groups]  # DCP's groups
        self._whole_order = [n for group in model.whole_group_names for n in group]  # a file's indices
        del self._whole
        mine = make_optimizer(spec, model, lr)
        if len(mine.param_groups) != len(whole.param_groups):
            raise DdpkitError(
                f"--pp: the task's optimizer makes {len(mine.param_groups)} param group(s) over stage "
                f"{self.pp_rank}'s parameters and {len(whole.param_groups)} over the whole model's: checkpoints name "
                "each stage's parameters in the whole model's groups; make the same groups whatever parameters it gets"
            )
        return mine

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    # -- the schedule ----------------------------------------------------------------
    def _pipe(self, n_micro: int, size: int, train: bool = True) -> Any:
        """The schedule for `n_micro` micro-batches of `size` samples (built at first use);
        evaluation's the same stages without a backward."""
        key = (n_micro, size, train)
        if key not in self._pipes:
            from torch.distributed.pipelining import PipelineStage

            stages = [
                PipelineStage(m, i, self.n_stages, self.rt.device, group=self.pp_group)
                for m, i in zip(self.stages, self.stage_ids, strict=True)
            ]
            self._pipes[key] = _schedule_class(self.schedule_name, n_micro, self.pp, train)(
                stages if self.per_rank > 1 else stages[0],
                n_microbatches=n_micro,
                loss_fn=self._loss,
                scale_grads=False,
            )
        return self._pipes[key]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean loss weighted by its share of the global batch."""
        return self.loss_fn(output, target) * (target.shape[0] * self._weight)

    def run_share(self, steps: Any, batch: Any, n_local: int, n_global: int) -> Any:
        """Forward and backward of this rank's share through the pipeline (the schedule runs
        the micro-batches); returns what StepRunner's own micro-batch loop would."""
        if steps.accumulate > 1:
            raise DdpkitError(
                "--accumulate with --pp: the pipeline's micro-batches are the accumulation; use --pp-microbatches"
            )
        inputs, target = _inputs_target(map_tensors(batch, lambda t: t.to(self.rt.device)))
        if n_local == 0:
            raise DdpkitError(
                "--pp: a step left a pipeline without samples (more data-parallel ranks than samples in a "
                "short last batch): use a global batch that is a multiple of dp, or drop the last batch"
            )
        n_micro = largest_divisor(n_local, self.microbatches)
        self._weight, losses = 1.0 / n_global, []
        with self.autocast():
            self._run(self._pipe(n_micro, n_local // n_micro), inputs, target, True, losses)
        self._sum_over_dp()
        totals = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        loss = None
        if self.is_last:  # the micro-batches' weighted losses, back to a sum over this share's samples
            loss = torch.stack([v.detach().double() for v in losses]).sum() / self._weight
            totals[0], totals[1] = loss, float(n_local)
        return totals, steps._local_flags(loss, None, totals[1]), False

    def _sum_over_dp(self) -> None:
        """The stages' gradients summed over the dp ranks, in one all-reduce (a parameter
        without a gradient on this rank adds zeros: every rank sends the same layout)."""
        if self.dp == 1 or self.dp_group is None:
            return
        params = [p for stage in self.stages for p in stage.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        for p, summed in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
            if p.grad is None:
                p.grad = summed
            else:
                p.grad.copy_(summed)

    def _run(self, schedule: Any, inputs: tuple, target: torch.Tensor, train: bool, losses: list) -> Any:
        call = schedule.step if train else schedule.eval
        if self.is_first and self.is_last:
            return call(*inputs, target=target, losses=losses)
        if self.is_first:
            return call(*inputs)
        if self.is_last:
            return call(target=target, losses=losses)
        return call()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The whole model's norm: the squares of every stage's gradients summed over pp."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        square = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        for g in grads:
            square += g.double().pow(2).sum()
        if self.pp_group is not None:
            dist.all_reduce(square, group=self.pp_group)
        norm = square.sqrt()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return norm.float()

    # -- evaluation -----------------------------------------------------------------
    def eval_batches(self, dataset: Any, batch_size: int, num_workers: int = 0) -> Iterator[Any]:
        """The dp rank's slices: the stages of one pipeline run the same batches."""
        return eval_batches(dataset, batch_size, self.dp_rank, self.dp, num_workers)

    def eval_forward(self, module: nn.Module, batch: Any, n: int) -> Any:
        """One eval batch forward through the stages; on the last stage, a stand-in for the
        model that returns their output (None elsewhere: nothing to score)."""
        if n == 0:
            return None
        inputs, target = _inputs_target(batch)
        self._weight = 0.0
        output = self._run(self._pipe(1, n, train=False), inputs, target, False, [])
        return (lambda *args, **kwargs: output) if self.is_last else None

    # -- checkpoints ----------------------------------------------------------------
    def load_full(self, model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
        """A one-file checkpoint of the whole model (one process, DDP): this rank's stages'
        weights, and their optimizer state found by name (the file numbers the whole model's
        parameters in its optimizer's order; this rank's optimizer numbers its own)."""
        model.load_state_dict({k: ckpt["model"][k] for k in model.state_dict()})
        saved = ckpt["optimizer"]
        index_of = dict(zip(self._whole_order, (i for g in saved["param_groups"] for i in g["params"]), strict=True))
        names = {id(p): n for n, p in model.named_parameters()}
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        at = 0  # this optimizer's index of the next parameter
        for mine, theirs in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            ids = list(range(at, at + len(mine["params"])))
            for j, p in zip(ids, mine["params"], strict=True):
                if index_of[names[id(p)]] in saved["state"]:
                    state[j] = saved["state"][index_of[names[id(p)]]]
            at += len(ids)
            groups.append({**{k: v for k, v in theirs.items() if k != "params"}, "params": ids})
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Every stage's weights gathered to rank 0 (collective), in the whole model's order."""
        mine = ckpt_state.weights_to_save_now(model.state_dict()) if self.dp_rank == 0 else {}
        mine = {k: v.detach().cpu() for k, v in mine.items()}
        parts = self.rt.gather_object(mine)
        if not self.rt.is_main:
            return None
        merged = {k: v for part in parts for k, v in part.items()}
        return {k: merged[k] for k in self.full_names if k in merged}


def _schedule_class(name: str, n_micro: int, pp: int, train: bool) -> Any:
    """The schedule's class: --pp-schedule's, or, where it cannot run these micro-batches
    (1F1B needs as many as stages; evaluation has one), the same order of work done in rounds
    (GPipe; looped BFS for two stages a rank). Each gives the same gradients."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS

    if name == "interleaved-1f1b":
        return ScheduleInterleaved1F1B if train and n_micro >= pp else ScheduleLoopedBFS
    return Schedule1F1B if name == "1f1b" and train and n_micro >= pp else ScheduleGPipe


def _inputs_target(batch: Any) -> tuple[tuple, torch.Tensor]:
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and isinstance(batch[-1], torch.Tensor):
        return tuple(batch[:-1]), batch[-1]
    raise DdpkitError(
        "--pp needs (inputs..., target) batches scored by the task's loss_fn on the last stage "
        f"(got {type(batch).__name__}); dict batches and step hooks do not run through pipeline stages"
    )


def pipeline_for(config: Any, rt: Runtime, task: Any) -> PipelineStrategy:
    """--pp N's strategy for `task`: what cannot run through stages refused here, in the workers
    before the model is built (the launcher refuses, before any worker starts, the degrees the
    processes cannot form and the strategies and options not built with --pp: parallel/spec.py)."""
    if config.tp > 1:
        raise DdpkitError(f"--tp {config.tp} with --pp {config.pp}: tensor x pipeline parallel is not built; drop one")
    if task.step is not None:
        raise DdpkitError(
            "--pp: the task's step(model, batch) cannot run through pipeline stages; give a loss_fn(output, target)"
        )
    return PipelineStrategy(
        rt,
        config,
        pp=config.pp,
        schedule=config.pp_schedule,
        microbatches=config.pp_microbatches,
        blocks=task.fsdp_blocks,
        loss_fn=task.loss_fn,
    )
