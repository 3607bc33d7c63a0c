"""A Hugging Face model's own description, kept beside its run (RUN_DIR/hf_config/) when the run
starts, so that `ddpkit export --format hf` can later write a folder `from_pretrained` loads
without importing the task again (which may build large data sets) or holding the model:
the model's config.json (and generation_config.json), and which of its weights are one tensor
under several names. safetensors stores no shared tensors: as Hugging Face's save_pretrained
does, the export writes one name of each tied group and leaves out the names the model ties
again when it loads (`_tied_weights_keys`, e.g. lm_head.weight of a GPT-2)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import DdpkitError
from .file import replace_folder

HF_DIR = "hf_config"
TIES = "ddpkit-weights.json"  # {"class": ..., "skip": {name left out: the name that holds its tensor}}


def is_hf_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel at the root (its state dict names are what from_pretrained reads)."""
    transformers = sys.modules.get("transformers")  # a task that built one has imported it: never import it here
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def check_hf(model: nn.Module) -> None:
    """--export hf: refused before training for a model from_pretrained could not load."""
    if not is_hf_model(model):
        raise DdpkitError(
            f"--export hf: the task's model is a {type(model).__name__}, not a Hugging Face transformers "
            "PreTrainedModel; use --export safetensors"
        )


def left_out(model: nn.Module) -> dict[str, str]:
    """{name the export leaves out: the name whose tensor it is}: of every group of state dict names
    that hold one tensor, the names the model declares tied (HF's rule), keeping one; and the
    names the model asks save_pretrained to leave out (mapped to "")."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    patterns = [
        f"{prefix}.{key}" if prefix else key
        for prefix, module in model.named_modules()
        for key in (getattr(module, "_tied_weights_keys", None) or ())
    ]
    skip: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        declared = [n for n in names if any(re.search(p, n) for p in patterns)]
        keep = next((n for n in names if n not in declared), names[0])
        skip.update({n: keep for n in names if n != keep})
    present = {n for names in groups.values() for n in names}
    ignored = getattr(model, "_keys_to_ignore_on_save", None) or ()
    skip.update({n: "" for n in ignored if n in present and n not in skip})
    return skip


def record(model: nn.Module, run_dir: str | os.PathLike, required: bool = False) -> str | None:
    """Rank 0, at the start of a run: RUN_DIR/hf_config/ for a transformers model (replaced as a
    whole; nothing for any other model). A config transformers refuses to save is the user's to fix
    only when the run exports as hf (`required`); otherwise the reason is returned, to warn."""
    prepared, reason = prepare(model, required)
    if prepared is not None:
        put(prepared, run_dir)
    return reason


def prepare(model: nn.Module, required: bool = False) -> tuple[Path | None, str | None]:
    """What record() writes, into a temporary folder outside the run directory, from the model as
    the task built it (before a strategy wraps or shards it): (the folder or None, a warning or None);
    a DdpkitError when `required` and transformers refuses. Nothing is written in the run yet."""
    if not is_hf_model(model):
        return None, None
    tmp = Path(tempfile.mkdtemp(prefix="ddpkit-hf-config-"))
    try:
        _write(model, tmp)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = f"cannot save the model's Hugging Face config ({type(e).__name__}: {str(e)[:200]})"
        if required:
            raise DdpkitError(f"--export hf: {reason}; fix it, or use --export safetensors") from None
        return None, reason
    return tmp, None


def put(prepared: Path, run_dir: str | os.PathLike) -> None:
    """A prepared folder as RUN_DIR/hf_config/, replaced as a whole (a crash leaves the old one or
    the new one, never a mix: it is moved beside it first, then swapped in)."""
    folder = Path(run_dir) / HF_DIR
    tmp = folder.parent / f".{HF_DIR}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.move(str(prepared), tmp)
    replace_folder(tmp, folder)


def _write(model: Any, folder: Path) -> None:
    """What save_pretrained writes besides the weights, and which weights it leaves out."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(folder)
    (folder / TIES).write_text(json.dumps({"class": type(model).__name__, "skip": left_out(model)}, indent=1) + "\n")


def read(run_dir: str | os.PathLike) -> tuple[list[Path], dict[str, str]]:
    """The files an hf export copies (config.json, generation_config.json) and the names it leaves out."""
    folder = Path(run_dir) / HF_DIR
    if not (folder / "config.json").is_file() or not (folder / TIES).is_file():
        raise DdpkitError(
            f"{run_dir} holds no Hugging Face config ({HF_DIR}/, written when `ddpkit train` trains a "
            "transformers PreTrainedModel): its model is not one from_pretrained loads; use --format safetensors"
        )
    skip: dict[str, Any] = json.loads((folder / TIES).read_text())["skip"]
    files = [folder / n for n in ("config.json", "generation_config.json") if (folder / n).is_file()]
    return files, skip
