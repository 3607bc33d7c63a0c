"""`ddpkit export`: a run's model as safetensors files, or a folder Hugging Face's from_pretrained loads."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..errors import DdpkitError
from .options import option
from .parser import Command

EXPORT_HELP = (
    "Write a run's model as safetensors files, or as a folder Hugging Face's from_pretrained loads (--format hf: "
    "the weights, config.json and generation_config.json of a transformers model). Reads the run's newest "
    "checkpoint (one file, or FSDP's shards, read tensor by tensor: no process holds the whole model) or model.pt; "
    "above --max-shard-size the weights are split into files with an index, as Hugging Face does."
)


@dataclass(frozen=True)
class ExportOptions:
    run_dir: str | None = option(
        help="the run directory of `ddpkit train`", positional=True, nargs=None, metavar="RUN_DIR"
    )
    format: str = option(
        "safetensors",
        "safetensors: the weights as safetensors files; hf: a folder Hugging Face's from_pretrained loads "
        "(the weights and the model's config; a transformers model)",
        metavar="safetensors|hf",
    )
    out: str | None = option(
        help="the folder to write (must not exist, or be empty), or a bucket URL (uploaded when complete)",
        default_help="RUN_DIR/export",
    )
    checkpoint: str | None = option(
        help="which weights: a checkpoint's name in RUN_DIR/checkpoints (epoch-000004), model.pt, or a path",
        metavar="NAME",
        default_help="the newest: the newest checkpoint, or model.pt when at least as new",
    )
    max_shard_size: str = option(
        "5GB", "above this size (500MB, 2GiB, ...) the weights are split into files and an index", metavar="SIZE"
    )


def cmd_export(ns: argparse.Namespace) -> int:
    from ..checkpoint.export import export_run
    from ..storage.copy import local_output, local_run, shown_as
    from ..storage.location import is_url

    if is_url(ns.run_dir) and ns.out is None:
        raise DdpkitError(f"export {ns.run_dir}: a run in a bucket is exported to a place of its own: give --out")
    wanted = ns.checkpoint if ns.checkpoint and ns.checkpoint != "model.pt" else not ns.checkpoint
    later: list[str] = []  # an --out URL is written locally, then uploaded: what was written is said after
    say = later.append if is_url(ns.out) else (lambda line: print(line, flush=True))
    with local_run(ns.run_dir, wanted) as run_dir, local_output(ns.out, must_be_empty=True) as out:
        shown = shown_as(out, ns.out)
        export_run(run_dir, ns.format, out, ns.checkpoint, ns.max_shard_size, say=lambda line: say(shown(line)))
    for line in later:
        print(line)
    return 0


COMMAND = Command(
    cmd_export,
    "write a run's model as safetensors, or a Hugging Face folder (from_pretrained)",
    EXPORT_HELP,
    options=ExportOptions,
)
