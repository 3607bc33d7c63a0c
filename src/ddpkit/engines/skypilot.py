"""`ddpkit sky`'s decisions: the SkyPilot task that runs `ddpkit train` on every node of a
cluster. SkyPilot runs the task's `run` once per node with SKYPILOT_NODE_RANK, _NODE_IPS,
_NUM_NODES and _NUM_GPUS_PER_NODE set; `ddpkit train` reads them as its node flags
(environments/skypilot.py), so the `run` line is one command, the same on every node, with no
placement flag in it. By default the task is a managed job (`sky jobs launch`): SkyPilot
recovers it after a preemption or a failure (job_recovery) by running it again on new nodes,
and `--auto-resume` continues from the newest checkpoint in the run directory, which must
therefore outlive the nodes: a bucket (file_mounts) or a shared volume. The CLI
(cli/sky_cmd.py) only parses; the YAML is written here, by hand (no YAML package needed)."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config.launch import LaunchTable
from ..config.values import parse_memory
from ..errors import DdpkitError
from ..storage.location import is_url
from ..util.jobtoken import TOKEN_VAR
from .job import job_description, run_dir_of
from .slurm import config_of, train_arguments

MOUNT = "/ddpkit"  # where the bucket or the volume is mounted on every node; the default run directory's parent
CONFIG_DIR = "~/.ddpkit-job"  # where the config file travels (file_mounts), read by `ddpkit train --config`
RECOVERY = ("EAGER_NEXT_REGION", "FAILOVER")  # SkyPilot's job recovery strategies
BUCKET_MODES = ("MOUNT", "MOUNT_CACHED")
USE = "--nodes / --gpus-per-node of `ddpkit sky`"


@dataclass
class SkyTask:
    """What the task YAML says: the nodes, their resources, where the run directory lives, and
    the command (`ddpkit train ARGS`, run on every node)."""

    name: str
    train_args: list[str]
    run_dir: str
    nodes: int = 1
    accelerators: str | None = None  # "H100:8"
    cloud: str | None = None
    cpus: str | None = None  # "32+": at least
    memory: str | None = None  # "256+": at least, GB as SkyPilot reads it
    image_id: str | None = None  # "docker:IMAGE"
    bucket: str | None = None  # a name (SkyPilot makes the bucket) or a URI (s3://..., gs://...)
    bucket_mode: str = "MOUNT"
    volume: str | None = None
    config_file: str | None = None  # this machine's path; travels to CONFIG_DIR
    workdir: str | None = None
    setup: list[str] = field(default_factory=list)
    managed: bool = True
    recovery: str = "EAGER_NEXT_REGION"
    max_restarts_on_errors: int = 0
    secrets: list[str] = field(default_factory=list)  # names only: SkyPilot takes each value from the launching shell


def sky_command(
    opts: Any, command_line: str, parse_train: Callable[[list[str]], Any], train_config: Callable[[Any], Any]
) -> int:
    """`ddpkit sky` with its options `opts` (the fields of cli/sky_cmd.py's SkyOptions).
    `parse_train` parses the arguments of `ddpkit train`, `train_config` makes (checks) their
    RunConfig; `command_line` heads the YAML. Writes the task YAML, or prints it (--dry-run)."""
    args, train = train_arguments(opts.train_args, opts.config, parse_train, engine="SkyPilot", use=USE)
    train_config(train)  # validates values
    job = sky_job_description(opts, args)
    task = sky_task(opts, job, args, train.run_dir)
    check_run_dir_shared_sky(task, job, dry_run=opts.dry_run)
    text = render_task(task, command_line)
    if opts.dry_run:
        print(text, end="")
        return 0
    path = Path(opts.yaml or f"{task.name}.sky.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"ddpkit: wrote {path}; launch it with: {launch_line(task)} {shlex.quote(str(path))}")
    return 0


def launch_line(task: SkyTask) -> str:
    """The command that launches the task, each --secret by its name: SkyPilot reads the value
    from the launching shell's environment then, so no value is ever in the YAML. A job of
    several nodes gets a fresh job token, made in that shell for that launch only."""
    launch = f"sky jobs launch -n {task.name}" if task.managed else f"sky launch -c {task.name}"
    maker = [f"{TOKEN_VAR}=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"] * (
        TOKEN_VAR in task.secrets
    )
    return " ".join([*maker, launch, *(f"--secret {name}" for name in task.secrets)])


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def secret_names(given: list[str] | None) -> list[str]:
    """--secret NAME (repeated): environment variables' names; a value is refused (it would be
    written into the YAML)."""
    names = []
    for name in given or ():
        if "=" in name:
            raise DdpkitError(
                f"--secret {name.partition('=')[0]}=...: give the name only; SkyPilot takes its value from the "
                "shell you launch from (sky jobs launch --secret NAME), so it is never written into the YAML"
            )
        if not _ENV_NAME.match(name):
            raise DdpkitError(f"--secret {name!r}: the name of an environment variable (letters, digits, '_')")
        if name not in names:
            names.append(name)
    return names


def sky_job_description(opts: Any, args: list[str]) -> LaunchTable:
    """The job: the config file's [launch] table under `ddpkit sky`'s own flags."""
    return job_description(
        config_of(args),
        nodes=opts.nodes,
        gpus_per_node=opts.gpus_per_node,
        accelerator=opts.accelerator,
        cloud=opts.cloud,
        image=opts.image,
        cpus_per_worker=opts.cpus_per_worker,
        memory=opts.memory,
        volume=opts.volume,
        run_dir=opts.run_dir,
        job_name=opts.job_name,
        shared_run_dir=opts.shared_run_dir or None,
    )


def sky_task(opts: Any, job: LaunchTable, args: list[str], train_run_dir: str | None) -> SkyTask:
    """The task of `job` running `args`; refuses what SkyPilot could not run."""
    if opts.bucket and job.volume:
        raise DdpkitError("give --bucket or --volume ([launch] volume) for the run directory, not both")
    name = job.job_name or "ddpkit"
    if not all(c.isalnum() or c in "-_." for c in name):
        raise DdpkitError(
            f"job name {name!r}: use letters, digits, '-', '_' and '.' only (SkyPilot names clusters by it)"
        )
    accelerator, gpus = accelerators(job.accelerator, job.gpus_per_node)
    chosen = _bucket_url(job.run_dir or train_run_dir, job, opts) or run_dir_of(job, train_run_dir, local=False)
    shared = opts.bucket or job.volume
    run_dir = chosen or f"{MOUNT if shared else 'runs'}/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not train_run_dir:
        args = [*args, "--run-dir", run_dir]
    workers = gpus or 1
    return SkyTask(
        name=name,
        train_args=args,
        run_dir=run_dir,
        nodes=job.nodes or 1,
        accelerators=accelerator,
        cloud=job.cloud,
        cpus=f"{job.cpus_per_worker * workers}+" if job.cpus_per_worker else None,
        memory=f"{-(-parse_memory(job.memory, '[launch] memory') // 2**30)}+" if job.memory else None,
        image_id=image_id(job.image),
        bucket=opts.bucket,
        bucket_mode=opts.bucket_mode,
        volume=job.volume,
        config_file=config_of(args),
        workdir=str(Path(opts.workdir).resolve()) if opts.workdir else None,
        setup=list(opts.install or ()),
        managed=not opts.unmanaged,
        recovery=opts.recovery,
        max_restarts_on_errors=opts.max_restarts_on_errors,
        secrets=secret_names([*(getattr(opts, "secret", None) or ()), *[TOKEN_VAR] * ((job.nodes or 1) > 1)]),
    )


def _bucket_url(chosen: str | None, job: LaunchTable, opts: Any) -> str | None:
    """A bucket URL as the run directory: every node's `ddpkit train` stages it on the node and
    uploads its ranks' shards, rank 0 commits; with the credentials the VM has (its cloud
    identity) or the --secret names passed at launch. Nothing to mount: --bucket/--volume refused."""
    if not is_url(chosen):
        return None
    if opts.bucket or job.volume:
        raise DdpkitError(
            f"--run-dir {chosen}: a run kept in a bucket by URL needs no mounted --bucket or --volume; give one of them"
        )
    return chosen


def accelerators(accelerator: str | None, gpus_per_node: int | None) -> tuple[str | None, int]:
    """SkyPilot's `accelerators` ("H100:8") and the GPUs per node, from the GPU type (which may
    carry its count, "H100:8") and gpus_per_node."""
    if not accelerator:
        if gpus_per_node:
            raise DdpkitError(
                f"{gpus_per_node} GPU(s) per node of which type? SkyPilot picks machines by it: "
                "pass --accelerator (accelerator in [launch]), e.g. --accelerator H100"
            )
        return None, 0
    kind, sep, count = accelerator.partition(":")
    if sep and not count.isdigit():
        raise DdpkitError(f"accelerator {accelerator!r}: write TYPE or TYPE:COUNT, e.g. H100 or H100:8")
    given = int(count) if sep else None
    if given is not None and gpus_per_node is not None and given != gpus_per_node:
        raise DdpkitError(
            f"accelerator {accelerator!r} says {given} GPU(s) per node but gpus_per_node is {gpus_per_node}"
        )
    gpus = given or gpus_per_node or (0 if gpus_per_node == 0 else 1)
    if gpus == 0:
        raise DdpkitError(f"accelerator {kind} with 0 GPUs per node: drop the accelerator for CPU nodes")
    return f"{kind}:{gpus}", gpus


def image_id(image: str | None) -> str | None:
    """A container image as SkyPilot names one (docker:IMAGE)."""
    if not image:
        return None
    return image if image.startswith("docker:") else f"docker:{image}"


def check_run_dir_shared_sky(
    task: SkyTask,
    job: LaunchTable,
    dry_run: bool = False,
    warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
) -> None:
    """A job on several nodes writes one run directory from all of them, and a recovered job
    resumes from it on new nodes: it must be on the bucket or the volume (under MOUNT). Refused
    in one line otherwise, unless the job says the directory is shared (--shared-run-dir: a file
    system of the image); a dry run only warns. A one-node managed job is only warned."""
    shared = (task.bucket or task.volume) and (task.run_dir == MOUNT or task.run_dir.startswith(MOUNT + "/"))
    if shared or job.shared_run_dir or is_url(task.run_dir):  # a bucket's run outlives the machine
        return
    where = (
        f"not under {MOUNT}, where the bucket or volume is mounted"
        if task.bucket or task.volume
        else "on a node's disk"
    )
    if task.nodes < 2:
        if task.managed:
            warn(
                f"ddpkit: warning: the run directory {task.run_dir} is {where}: a job recovered on a new "
                "machine starts over (--bucket or --volume keep its checkpoints)"
            )
        return
    message = (
        f"the run directory {task.run_dir} is {where}, but the SkyPilot job spans {task.nodes} nodes: each "
        f"would write and resume from its own copy. Put it on a bucket (--bucket NAME) or a shared volume "
        f"(--volume NAME, volume in [launch]), under {MOUNT}, or pass --shared-run-dir (shared_run_dir = true "
        "in [launch]) if every node does see it"
    )
    if dry_run:
        warn(f"ddpkit: warning: {message}")
        return
    raise DdpkitError(message)


def run_line(task: SkyTask) -> str:
    """The command every node runs: `ddpkit train ARGS --auto-resume`, the config file by its
    place on the node."""
    words = []
    for a in task.train_args:
        if task.config_file and a in (task.config_file, f"--config={task.config_file}"):
            remote = f'"$HOME/{CONFIG_DIR[2:]}/"{shlex.quote(Path(task.config_file).name)}'
            words.append(remote if a == task.config_file else f"--config={remote}")
        else:
            words.append(shlex.quote(a))
    return " ".join(["ddpkit", "train", *words, "--auto-resume"])


def task_config(task: SkyTask) -> dict[str, Any]:
    """The task YAML's content (SkyPilot's keys: name, num_nodes, resources, workdir,
    file_mounts, volumes, setup, run)."""
    resources: dict[str, Any] = {}
    for key in ("cloud", "accelerators", "cpus", "memory", "image_id"):
        if getattr(task, key):
            resources[key] = getattr(task, key)
    if task.managed:
        resources["job_recovery"] = {"strategy": task.recovery, "max_restarts_on_errors": task.max_restarts_on_errors}
    out: dict[str, Any] = {"name": task.name, "num_nodes": task.nodes}
    if resources:
        out["resources"] = resources
    if task.workdir:
        out["workdir"] = task.workdir
    mounts: dict[str, Any] = {}
    if task.bucket:
        where = "source" if "://" in task.bucket else "name"
        mounts[MOUNT] = {where: task.bucket, "mode": task.bucket_mode}
    if task.config_file:
        mounts[f"{CONFIG_DIR}/{Path(task.config_file).name}"] = task.config_file
    if mounts:
        out["file_mounts"] = mounts
    if task.volume:
        out["volumes"] = {MOUNT: task.volume}
    if task.secrets:
        out["secrets"] = {name: None for name in task.secrets}  # null: resolved at launch (--secret NAME)
    if task.setup:
        out["setup"] = "\n".join(task.setup) + "\n"
    out["run"] = run_line(task) + "\n"
    return out


def render_task(task: SkyTask, command_line: str = "") -> str:
    """The task YAML: a comment that says how to launch it, then task_config()."""
    head = [f"# written by: {command_line}"] if command_line else []
    managed = "  (a managed job: recovered after a preemption or failure)" * task.managed
    head.append(f"# launch: {launch_line(task)} FILE{managed}")
    return "\n".join(head) + "\n" + "".join(_yaml(task_config(task), 0))


def _yaml(value: dict[str, Any], indent: int) -> list[str]:
    """A mapping as YAML lines: scalars as JSON (a YAML flow scalar), text of several lines as a
    literal block."""
    pad = " " * indent
    out = []
    for key, v in value.items():
        k = json.dumps(key) if not all(c.isalnum() or c in "_-/~." for c in key) else key
        if isinstance(v, dict):
            out += [f"{pad}{k}:\n", *_yaml(v, indent + 2)]
        elif isinstance(v, str) and "\n" in v:
            body = "".join(f"{pad}  {line}\n" if line else "\n" for line in v.rstrip("\n").split("\n"))
            out += [f"{pad}{k}: |\n", body]
        else:
            out.append(f"{pad}{k}: {json.dumps(v)}\n")
    return out
