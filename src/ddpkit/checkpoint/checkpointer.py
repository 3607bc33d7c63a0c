"""The checkpointer: the one owner of a run's checkpoints.

What one holds is the `Header` (schema.py: the one schema both kinds write and resume reads): the run's
position (in samples of the epoch's global order, state.py), the state of every part that
registered itself (a `Part`: the LR scheduler, the gradient scaler, a stream's readers, ...),
every rank's RNG states and the config; beside it the model and optimizer in the strategy's
kind: one file written by rank 0 (file.py: DDP) or a folder of shards written by every rank
(sharded.py: FSDP).

When one is due (every N epochs, every N optimizer steps, every N minutes on rank 0's clock,
on a signal), which one a resume takes (the newest that is complete and fits), which are kept
(--keep-last, --keep-best) and whether one is written in the background (--async-save) are
decided here and nowhere else.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, cast

import torch
from torch import nn

from ..config.faults import Faults
from ..errors import DdpkitError
from . import bucket
from . import file as ckpt_file
from .memory import MemorySnapshots, shard_plan, wanted
from .retention import prune, record_metric
from .schema import Header
from .snapshot import SnapshotStore
from .state import Position, plain_state_dict, rng_state, set_rng_state, unwrap, weights_finite


class Part(Protocol):
    """A piece of a run's state that a checkpoint keeps under the part's name."""

    def state(self) -> Any: ...

    def load(self, state: Any) -> None: ...


class Stateful:
    """A part made of an object with torch's state_dict()/load_state_dict() (an LR scheduler, a
    gradient scaler)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state(self) -> Any:
        return self.obj.state_dict()

    def load(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class ModelState(Protocol):
    """What the strategy tells the checkpointer (strategies/base.py): the kind it writes, and how
    a one-file checkpoint goes into its model (whole, or each rank's shards of it)."""

    checkpoint_kind: str  # "file" or "sharded"

    def load_full(self, model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None: ...


class ShardedModelState(ModelState, Protocol):
    """A sharded strategy (FSDP/HSDP) also keeps and loads each rank's own shards (memory snapshots)."""

    shard: tuple[int, int]  # (this rank's shard index, the number of shards)

    def local_shards(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    def load_local_shards(self, model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None: ...


class Checkpointer:
    """A run's checkpoints: register the parts, then ask when one is due, save, resume."""

    def __init__(
        self,
        run_dir: Path,
        rt: Any,
        strategy: ModelState,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        faults: Faults,
        config: dict[str, Any],
        mark: Any = None,
    ) -> None:
        self.run_dir, self.rt, self.strategy, self.model, self.optimizer = run_dir, rt, strategy, model, optimizer
        self.faults, self.config = faults, config  # when checkpoints are written and which stay
        self.mark = mark  # world_mark.py: a world that no longer owns the run directory writes no checkpoint there
        self.parts: dict[str, Part] = {}
        self.writer = ckpt_file.BackgroundWriter() if faults.async_save else None
        self.last_save = time.monotonic()
        self.memory = self._memory(faults.snapshot_every_steps)
        # The newest checkpoint whose weights this run saw finite (at its save, or once resumed
        # from): what the NaN guard may name; None until then.
        self.finite_checkpoint: str | None = None
        self.saved_step: int | None = None  # the global step of the newest checkpoint this run wrote

    def _memory(self, every: int | None) -> MemorySnapshots | None:
        """Snapshots in each node's memory under a restarting agent: DDP's local rank 0 keeps its
        replica; under FSDP/HSDP every rank keeps its own shards."""
        if every == 0 or not wanted() or self.sharded and not hasattr(self.strategy, "local_shards"):
            return None  # a pipeline's stages keep no snapshots: a restart resumes from the disk checkpoint
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        if self.sharded:
            store = _node_store(run_id, self._shards.shard)
            return MemorySnapshots(self.rt, every, store, sharded=True)
        store = _node_store(run_id) if self.rt.env.local_rank == 0 else None
        return MemorySnapshots(self.rt, every, store)

    @property
    def sharded(self) -> bool:
        return self.strategy.checkpoint_kind == "sharded"

    @property
    def _shards(self) -> ShardedModelState:
        return cast(ShardedModelState, self.strategy)

    def register(self, name: str, part: Part) -> None:
        self.parts[name] = part
        if name == "stream" and self.memory is not None:
            self.memory = None  # every rank's place in its shards is gathered: disk checkpoints only

    # -- when -----------------------------------------------------------------------
    def clock_due(self) -> bool:
        """--save-every-minutes on rank 0's clock (the step's agreement makes it every rank's)."""
        minutes = self.faults.save_every_minutes
        return minutes is not None and self.rt.is_main and time.monotonic() - self.last_save >= minutes * 60

    def due_after_step(self, global_step: int, signal: bool, clock: bool) -> bool:
        every = self.faults.save_every_steps
        return signal or clock or bool(every) and global_step % every == 0

    def due_after_pass(self, epochs_done: int, global_step: int, last: bool, stopping: bool) -> bool:
        every, steps = self.faults.save_every, self.faults.save_every_steps
        return (
            stopping or bool(steps) and global_step % steps == 0 or bool(every) and (epochs_done % every == 0 or last)
        )

    # -- writing --------------------------------------------------------------------
    def snapshot_due(self) -> bool:
        """Every step boundary counts (the step done is recorded; a snapshot every K)."""
        return self.memory is not None

    def snapshot(self, global_step: int, position: Callable[[], Position]) -> None:
        """Every rank at every step boundary while snapshots are on; only local rank 0 writes
        (a one-file checkpoint of its replica with every rank's RNG state, copied to the CPU here)."""
        assert self.memory is not None

        def state() -> dict[str, Any]:
            pos = position()  # a collective inside a pass
            rngs = self.rt.all_gather_object(rng_state())  # a restart at this world size goes on exactly
            if self.memory is None or self.memory.store is None:
                return {}
            header = Header(
                pos,
                ckpt_file.cpu_copy({name: part.state() for name, part in self.parts.items()}),
                rngs,
                self.rt.world_size,
                self.config,
                ckpt_file.signature_of(unwrap(self.model)),
                ckpt_file.groups_of(unwrap(self.model), self.optimizer),
            )
            if self.sharded:  # this rank's shards only (no collective)
                return {**header.to_dict(), **self._shards.local_shards(self.model, self.optimizer)}
            return {
                **header.to_dict(),
                "model": plain_state_dict(self.model),
                "optimizer": ckpt_file.cpu_copy(self.optimizer.state_dict()),
            }

        self.memory.after_step(global_step, state)

    def restarting(self, asked: bool) -> bool:
        """Collective while snapshots are on: whether every rank resumes, as one does. A rank does
        when asked (--resume, --auto-resume, a restart torch counted), or when its node's memory
        holds this job's progress: torch restarts the workers to admit a joining node without
        counting it, and the joining node's workers know of no restart."""
        if self.memory is None:
            return asked
        return any(self.rt.all_gather_object(asked or self.memory.held().get("progress") is not None))

    def end_snapshots(self) -> None:
        if self.memory is not None:
            self.memory.end()

    def save(self, position: Position, record: dict[str, Any] | None = None) -> None:
        """Collective: every rank's RNG state (on rank 0) and parts, then the strategy's kind of checkpoint;
        `record`: the metrics at this checkpoint (--keep-best ranks by one of them)."""
        header = Header(
            position,
            {name: part.state() for name, part in self.parts.items()},
            self.rt.gather_object(rng_state()) or [],  # rank 0 writes the header (sharded too)
            self.rt.world_size,
            self.config,
            ckpt_file.signature_of(unwrap(self.model)),
            ckpt_file.groups_of(unwrap(self.model), self.optimizer),
        )
        taken = self.mark is not None and self.mark.lost()
        finite, taken = weights_finite(self.model, self.rt.collectives, self.rt.device, taken)
        if taken:
            raise self.mark.error(f"the checkpoint of step {position.global_step}")
        if not finite:
            raise DdpkitError(
                f"the weights hold NaN/inf at epoch {position.epoch + 1}; no checkpoint written, the last one is intact"
            )
        path = ckpt_file.checkpoint_path(self.run_dir, position.epoch, position.name_step)
        value = (record or {}).get(self.faults.best_metric.split(":")[0])
        metric = (path.stem, value) if value is not None else None
        if self.strategy.checkpoint_kind == "sharded":
            from .sharded import save_dcp  # torch.distributed.checkpoint: ~0.5 s to import

            if self.writer is not None:
                self.writer.wait()  # the previous upload reads its folder: pruning waits for it
            if self.rt.is_main:
                bucket.uncommit(path.with_suffix("").name)
            final = save_dcp(self.run_dir, header, self.model, self.optimizer, self.rt)
            self.prune(metric)
            self._publish(final)
        elif self.rt.is_main:
            self._write_file(header, path, metric)
        self.last_save = time.monotonic()
        self.saved_step = position.global_step
        self.finite_checkpoint = str(path if self.strategy.checkpoint_kind != "sharded" else path.with_suffix(""))

    def _write_file(self, header: Header, path: Path, metric: tuple[str, float] | None) -> None:
        """Rank 0: one file, atomically; in a thread with --async-save (on CPU copies)."""
        background = self.writer is not None
        copy = ckpt_file.cpu_copy if background else (lambda x: x)
        header.parts = copy(header.parts)
        state = {
            **header.to_dict(),
            "model": plain_state_dict(self.model),
            "optimizer": copy(self.optimizer.state_dict()),
        }

        def write() -> None:
            ckpt_file.save_or_explain(state, path)
            self.prune(metric)
            bucket.publish(self.run_dir, path, self.faults)

        if background:
            self.writer.submit(write)
        else:
            write()

    def _publish(self, final: Path) -> None:
        """Every rank, a sharded checkpoint complete in the run folder: its shards to the bucket,
        if the run is stored in one; rank 0 commits (in the background with --async-save)."""
        if bucket.current() is None:
            return
        rank, world = self.rt.rank, self.rt.world_size
        folder = bucket.shards_folder(final)  # now: the background job runs after the node's next save began
        job = lambda: bucket.publish_shards(self.run_dir, folder, self.faults, rank, world)  # noqa: E731
        if self.writer is not None:
            self.writer.submit(job)
        else:
            job()

    def prune(self, metric: tuple[str, float] | None = None) -> None:
        """--keep-last/--keep-best: rank 0 records the new checkpoint's metric, then deletes what
        a complete newer checkpoint makes old."""
        keep, best = self.faults.keep_last, self.faults.keep_best
        if best and self.rt.is_main and metric is not None:
            record_metric(self.run_dir, *metric)
        if (keep or best) and self.rt.is_main:
            prune(self.run_dir, keep, best, maximize=self.faults.best_metric.endswith(":max"))

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Leave only once the last background checkpoint is written; on an error, wait for it
        too (its own error, if any, is not the one to report then)."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.wait()
            raise
        self.wait()

    def wait(self) -> None:
        """--async-save: block until the last checkpoint is on disk (raises its error, if any)."""
        if self.writer is not None:
            self.writer.wait()
        if self.memory is not None and self.memory.store is not None:
            self.memory.store.wait()  # on a peer's failure too: the newest snapshot is complete before the restart

    # -- resuming -------------------------------------------------------------------
    def resume(self, required: bool, data_size: int | None, global_batch: int, quiet: bool = False) -> Position:
        """Collective: the newest checkpoint that is complete and fits, into the model, the
        optimizer, the parts and the RNG; its position. `required` (--resume): no checkpoint is
        an error; otherwise (--auto-resume) none at all means a fresh start. `data_size` (None for
        a stream) and `global_batch` are this run's: an older checkpoint's place in steps is
        turned into samples only where that is exact."""
        several = bucket.several_nodes(self.rt)  # every node stages its own copy: the bucket is the one truth
        if several:
            bucket.sync_for_resume(self.run_dir, self.rt)
        kind, payload, path = self._newest(self._on_disk(required) if self.rt.is_main else None)
        if kind == "error":
            raise DdpkitError(payload)
        if kind == "fresh":
            return Position()
        if several and kind == "sharded":  # rank 0's path is in its node's staging folder
            path = str(self.run_dir / ckpt_file.CKPT_DIR / Path(path).name)
            bucket.fetch_chosen(Path(path), self.rt)
        header = Header.read(payload, path, data_size, global_batch)  # before loading: a refusal changes nothing
        self._check_parts(header.parts)
        if kind == "file":
            self.strategy.load_full(self.model, self.optimizer, payload)
        elif kind == "shards":
            self._shards.load_local_shards(self.model, self.optimizer, payload)
        else:
            from .sharded import load_dcp

            load_dcp(Path(path), self.model, self.optimizer)
        for name, part in self.parts.items():
            if name in header.parts:
                part.load(header.parts[name])
        set_rng_state(header.rng[self.rt.rank] if len(header.rng) == self.rt.world_size else header.rng[0])
        self._check_finite(path)
        self.prune()  # a crash between a save and its pruning left one too many
        pos = header.position
        if not quiet:
            where = f"epoch {pos.epoch} done" + (
                f", {pos.samples} samples into epoch {pos.epoch + 1}" if pos.mid_epoch else ""
            )
            self.rt.print(f"ddpkit: resuming from {bucket.shown(path, self.run_dir)} ({where})")
        return pos

    def _check_finite(self, path: str | None) -> None:
        """Collective: the weights just loaded are finite on every rank. A save refuses NaN/inf
        weights, so a checkpoint holding them was changed after it was written (its checksums
        rewritten too: they guard against accidents only); one-file checkpoints are skipped for it
        before loading (file.validate_checkpoint), this catches every other kind."""
        finite, _ = weights_finite(self.model, self.rt.collectives, self.rt.device)
        if not finite:
            raise DdpkitError(
                f"--resume: {path}: its weights hold NaN/inf, which ddpkit never saves: it was changed after it was "
                "written; move it out of the checkpoints folder and --resume takes the previous one"
            )
        self.finite_checkpoint = path

    def _on_disk(self, required: bool) -> tuple[str, Any, str | None]:
        """Rank 0: the newest disk checkpoint that is complete and fits, as (kind, payload, path)."""
        from .sharded import find_any_resumable, list_sharded  # torch.distributed.checkpoint: ~0.5 s

        try:
            if not required and not ckpt_file.list_checkpoints(self.run_dir) and not list_sharded(self.run_dir):
                return ("fresh", None, None)
            kind, ckpt, path, skipped = find_any_resumable(self.run_dir, self.model, self.optimizer)
            for reason in skipped:
                print(f"ddpkit: skipping checkpoint: {reason}", flush=True)
            return (kind, ckpt, str(path))
        except DdpkitError as e:
            return ("error", str(e), None)

    def _newest(self, disk: tuple[str, Any, str | None] | None) -> tuple[str, Any, str | None]:
        """Collective: whichever is newer, rank 0's disk checkpoint or the newest snapshot any
        node holds in memory (the lowest rank holding it reads it), on every rank. Every rank
        sees what every other holds, so all agree on the step without another round."""
        if self.memory is None:
            return self.rt.broadcast_object(disk)
        disk_step = None
        if disk is not None and disk[0] in ("file", "sharded"):
            disk_step = int(disk[1].get("global_step") or 0)
        everyone = self.rt.all_gather_object({**self.memory.held(), "disk": disk_step})
        disk_step = everyone[0]["disk"]
        if self.sharded:
            return self._newest_shards(everyone, disk, disk_step)
        offers = [(h["snapshot"], -rank) for rank, h in enumerate(everyone) if h.get("snapshot") is not None]
        step, source = max(offers, default=(-1, 0))
        if offers and (disk_step is None or step > disk_step):
            where = f"memory (the snapshot of step {step} on rank {-source}'s node)"
            mine = ("file", self.memory.read(step), where) if self.rt.rank == -source else None
            self.memory.restarted(everyone, "memory", step, disk_step)
            return self.rt.broadcast_object(mine, src=-source)
        self.memory.restarted(everyone, "disk", disk_step or 0, disk_step)
        return self.rt.broadcast_object(disk)

    def _newest_shards(
        self, everyone: list[dict[str, Any]], disk: tuple[str, Any, str | None] | None, disk_step: int | None
    ) -> tuple[str, Any, str | None]:
        """Sharded: memory serves when every shard of one step newer than the disk checkpoint is
        held by some node; each rank takes its own shard index's (memory.shard_plan). Otherwise
        the disk checkpoint, and rank 0 says why memory could not serve."""
        assert self.memory is not None
        count = self._shards.shard[1]
        plan = shard_plan(everyone, count)
        if isinstance(plan, tuple) and (disk_step is None or plan[0] > disk_step):
            step, sources = plan
            received = sum(src != rank for rank, src in enumerate(sources))
            where = f"memory (each rank's shards of step {step}; {received} rank(s) received theirs from another node)"
            mine = self.memory.fetch_shards(step, sources, count)
            self.memory.restarted(everyone, "memory", step, disk_step)
            return ("shards", mine, where)
        if isinstance(plan, str) and any(h.get("progress") for h in everyone):
            fallback = "no checkpoint" if disk_step is None else f"the disk checkpoint of step {disk_step}"
            self.rt.print(f"ddpkit: memory snapshots cannot resume this run: {plan}; resuming from {fallback}")
        self.memory.restarted(everyone, "disk", disk_step or 0, disk_step)
        return self.rt.broadcast_object(disk)

    def _check_parts(self, saved: dict[str, Any]) -> None:
        """A part the run has and the checkpoint lacks, or the other way round, would silently
        restart or drop it (an LR schedule, a gradient scaler): refused."""
        for name in sorted((set(self.parts) ^ set(saved)) & set(KNOWN_PARTS)):
            has = "the checkpoint has" if name in saved else "this run has"
            raise DdpkitError(
                f"--resume: {has} {KNOWN_PARTS[name]} and the other does not; resume with the settings of "
                "the run that wrote the checkpoint"
            )


def _node_store(run_id: str, shard: tuple[int, int] | None = None) -> SnapshotStore | None:
    """This node's snapshot folder, or None (and one line saying why) when it is not this job's own."""
    try:
        return SnapshotStore.for_this_node(run_id, shard=shard)
    except DdpkitError as e:
        print(f"ddpkit: warning: {e}", flush=True)
        return None


KNOWN_PARTS = {
    "scheduler": "an LR scheduler (--lr-schedule/--warmup-steps or Task.scheduler)",
    "scaler": "an fp16 gradient scaler",
    "stream": "a stream's position (a streaming train_set)",
}
