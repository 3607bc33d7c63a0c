"""A run directory's start, in a worker: what is prepared before training (the world's mark, the
model's Hugging Face config kept aside) and what rank 0 writes there once nothing refused the run.

A refusal before the start (the task, --init-from, the resume) leaves the folder as it was: a
finished run stays finished. api.prepare_local_run, in the launcher, picked the folder and
checked that starting there loses nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from ..errors import DdpkitError
from ..runtime.watchdog import fresh_hang_dir
from ..util.envvars import RUN_URL_VAR
from . import hf_config
from .file import remove_stale_temporaries
from .world_mark import WorldMark

if TYPE_CHECKING:
    from ..config import RunConfig


@dataclass
class RunDirStart:
    """What prepare_run_dir() gives the run: `mark`, this world's claim on the folder (claimed at
    the start); `hf`, the model's Hugging Face config prepared aside (rank 0, or None); `not_kept`,
    why it could not be (a warning, or None)."""

    cfg: RunConfig
    run_dir: Path
    is_main: bool
    mark: WorldMark
    hf: Path | None
    not_kept: str | None

    def begin(self) -> None:
        """Rank 0, once nothing refused the run: the folder is this world's from now on. Everything
        the start writes is written here. A full disk is one line."""
        if self.is_main:
            begin_run_dir(self.cfg, self.run_dir, self.mark, self.hf)


def prepare_run_dir(
    cfg: RunConfig,
    run_dir: Path,
    is_main: bool,
    world_size: int,
    nnodes: int,
    model: nn.Module,
    cleanup: contextlib.ExitStack,
) -> RunDirStart:
    """Nothing is written in `run_dir` yet: this world's mark (the folder is its own once it
    starts) and, on rank 0, the Hugging Face config of `model` as built (before a strategy shards
    it), in a temporary folder `cleanup` removes (once moved into the run, nothing is left there).
    `cfg` is the run's settings as config.json records them."""
    mark = WorldMark(run_dir, is_main, world_size, nnodes)
    hf, not_kept = hf_config.prepare(model, required=cfg.export == "hf") if is_main else (None, None)
    if hf is not None:
        cleanup.callback(shutil.rmtree, hf, ignore_errors=True)
    return RunDirStart(cfg, run_dir, is_main, mark, hf, not_kept)


OWN_FILES = ("config.json", "summary.json", "failed.json", "metrics.jsonl", "metrics.csv", "model.pt")


def refuse_linked_files(run_dir: Path) -> None:
    """The files a run writes in its folder are its own: one that is a symbolic link (a crafted
    or copied folder) would have the run write through it, over a file elsewhere."""
    for name in OWN_FILES:
        if (run_dir / name).is_symlink():
            raise DdpkitError(
                f"{run_dir / name} is a symbolic link (to {os.readlink(run_dir / name)}): a run writes that "
                "file itself; remove the link, or choose another --run-dir"
            )


def begin_run_dir(cfg: RunConfig, run_dir: Path, mark: WorldMark, hf: Path | None) -> None:
    """Rank 0's start of the run in `run_dir`: the folder, this world's claim, a fresh hang/,
    config.json and the Hugging Face config `hf` (hf_config.prepare). A full disk is one line."""
    refuse_linked_files(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(run_dir)  # what a killed save left: it may be what filled the disk
        mark.claim()  # before this world writes there: a world still training there stops at its next step
        fresh_hang_dir(run_dir / "hang")
        record = cfg.as_dict()
        if os.environ.get(RUN_URL_VAR):  # the folder is the bucket's staging copy: the run is at the URL
            record["run_dir"] = os.environ[RUN_URL_VAR]
        (run_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")
        if hf is not None:
            hf_config.put(hf, run_dir)  # for export --format hf
    except OSError as e:
        raise DdpkitError(
            f"cannot write to the run directory {run_dir}: {e.strerror or e} ({e.filename or run_dir}); "
            "free space (or fix the folder) and start again (with --resume to continue)"
        ) from None
