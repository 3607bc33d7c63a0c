"""`ddpkit k8s`'s decisions: the Kubernetes job a training becomes (how many pods, what each asks
for, where the run directory lives, how long a pod has to save when it is evicted) and the checks
made before anything is written. trainjob.py renders it with Kubeflow's own API models and
writes it; the CLI (cli/k8s_cmd.py) only parses.

Choice: ONE POD PER NODE, `ddpkit train` its container's command. Kubeflow Trainer's torch runtime
sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT in every pod
(a PyTorchJob with nprocPerNode does too); `ddpkit train` reads them as torchrun reads its flags
(environments/kubeflow.py) and starts one worker per GPU. The run directory is on a shared volume
(a PersistentVolumeClaim every pod mounts). An evicted or preempted pod gets SIGTERM: every rank saves
at the next step (--save-on-signal TERM), every pod exits 143, the JobSet (the PyTorchJob's
ExitCode policy) starts the job again, and it continues from that checkpoint (--auto-resume).
terminationGracePeriodSeconds must cover the save: after it the kubelet kills."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from ..config.file import FIELDS
from ..config.launch import LaunchTable
from ..config.values import parse_memory
from ..errors import DdpkitError
from ..storage.location import is_url
from .job import job_description, run_dir_of
from .slurm import SLURM_PLACES, config_of, placement_flags

CONFIG_MOUNT = "/etc/ddpkit"  # where the ConfigMap with the --config file is mounted in every pod
# a name that makes valid pod host names: <name>-node-0-0 within 63 characters
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_LABEL = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_./]*)?[A-Za-z0-9]$")


@dataclass(frozen=True)
class Volume:
    """A PersistentVolumeClaim every pod mounts at `mount`."""

    claim: str
    mount: str

    @classmethod
    def parse(cls, text: str) -> Volume:
        """PVC[:MOUNT] (MOUNT: /mnt/PVC by default)."""
        claim, _, mount = text.partition(":")
        if not _NAME.match(claim) and not re.match(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", claim):
            raise DdpkitError(f"--volume {text!r}: the claim's name must be a Kubernetes name (a-z, 0-9, '-', '.')")
        mount = mount or f"/mnt/{claim}"
        if not PurePosixPath(mount).is_absolute():
            raise DdpkitError(f"--volume {text!r}: the mount point {mount!r} must be an absolute path in the pod")
        return cls(claim, str(PurePosixPath(mount)))


@dataclass(frozen=True)
class KubeJob:
    """Everything the YAML says, checked: one pod per node, `procs` workers in each."""

    name: str
    image: str
    command: list[str]
    run_dir: str
    nodes: int = 1
    gpus_per_node: int = 0
    procs: int = 1  # workers per pod: one per GPU, or workers_per_node on CPU nodes
    cpus_per_worker: int | None = None
    memory: str | None = None  # per node (pod)
    namespace: str | None = None
    volume: Volume | None = None
    accelerator: str | None = None  # node selector: VALUE of nvidia.com/gpu.product, or LABEL=VALUE
    grace_period_s: int = 300
    max_restarts: int = 5
    deadline_s: int | None = None  # [launch] time: the job's activeDeadlineSeconds
    config_file: str | None = None  # the --config file's name, carried by a ConfigMap
    config_text: str | None = None
    env_secret: str | None = None  # a Secret every pod's environment comes from (envFrom): a bucket's credentials

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"

    @property
    def resources(self) -> dict[str, dict[str, str]]:
        """One pod's requests and limits (a node's GPUs, its workers' CPUs, its memory)."""
        requests: dict[str, str] = {}
        if self.cpus_per_worker:
            requests["cpu"] = str(self.cpus_per_worker * self.procs)
        if self.memory:
            requests["memory"] = f"{-(-parse_memory(self.memory, '--memory') // 2**20)}Mi"
        limits = dict(requests)
        if self.gpus_per_node:
            limits["nvidia.com/gpu"] = str(self.gpus_per_node)
        return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}

    @property
    def node_selector(self) -> dict[str, str] | None:
        if not self.accelerator:
            return None
        label, _, value = self.accelerator.rpartition("=")
        return {label or "nvidia.com/gpu.product": value}


def pod_command(train_args: list[str], run_dir: str, python: str = "python") -> list[str]:
    """What every pod's container runs: `ddpkit train` (its node and rank from Trainer's PET_*
    variables), continuing a checkpoint in the run directory if there is one, saving at the next step
    on SIGTERM (an eviction: the pod then exits 143 and the job is started again)."""
    args = list(train_args)
    if not any(a == "--run-dir" or a.startswith("--run-dir=") for a in args):
        args += ["--run-dir", run_dir]
    return [python, "-m", "ddpkit", "train", *args, "--auto-resume", "--save-on-signal", "TERM"]


def k8s_job_description(opts: Any, config: str | None) -> LaunchTable:
    """The job: the [launch] table of the config file (on this machine) under `ddpkit k8s`'s own flags."""
    return job_description(
        config,
        nodes=opts.nodes,
        gpus_per_node=opts.gpus_per_node,
        workers_per_node=opts.workers_per_node,
        cpus_per_worker=opts.cpus_per_worker,
        memory=opts.memory,
        time=opts.time,
        image=opts.image,
        namespace=opts.namespace,
        volume=opts.volume,
        accelerator=opts.accelerator,
        run_dir=opts.run_dir,
        job_name=opts.job_name,
    )


def kube_job(opts: Any, parse_train: Callable[[list[str]], Any], train_config: Callable[[Any], Any]) -> KubeJob:
    """The checked job of `ddpkit k8s` with its options `opts` (cli/k8s_cmd.py's K8sOptions)."""
    args, train, config = pod_train_arguments(opts.train_args, opts.config, parse_train)
    train_config(train)  # validates the values now, not in a pod an hour later
    job = k8s_job_description(opts, config)
    name = job.job_name or f"ddpkit-{time.strftime('%Y%m%d-%H%M%S')}"
    if not _NAME.match(name):
        raise DdpkitError(
            f"job name {name!r}: use at most 40 lowercase letters, digits and '-', starting with a letter "
            "(the pods' host names are NAME-node-0-0)"
        )
    if not job.image:
        raise DdpkitError("the pods need a container image with ddpkit installed: --image IMAGE (image in [launch])")
    nodes, gpus = job.nodes or 1, job.gpus_per_node or 0
    volume = Volume.parse(job.volume) if job.volume else None
    run_dir = _bucket_run_dir(job.run_dir or train.run_dir, volume)
    run_dir = run_dir or _pod_run_dir(run_dir_of(job, train.run_dir, local=False), volume, nodes, name)
    return KubeJob(
        name=name,
        image=job.image,
        command=pod_command(args, run_dir),
        run_dir=run_dir,
        nodes=nodes,
        gpus_per_node=gpus,
        procs=_procs(job.workers_per_node, gpus),
        cpus_per_worker=job.cpus_per_worker,
        memory=job.memory,
        namespace=_checked_name(job.namespace, "namespace"),
        volume=volume,
        accelerator=_checked_accelerator(job.accelerator),
        grace_period_s=_at_least(opts.grace_period, 1, "--grace-period"),
        max_restarts=_at_least(opts.max_restarts, 0, "--max-restarts"),
        deadline_s=job.time_limit_s,
        config_file=Path(config).name if config else None,
        config_text=Path(config).read_text() if config else None,
        env_secret=_checked_name(opts.env_secret, "--env-secret") if getattr(opts, "env_secret", None) else None,
    )


def _bucket_run_dir(chosen: str | None, volume: Volume | None) -> str | None:
    """A bucket URL as the run directory: every pod's `ddpkit train` stages it in the pod and
    uploads its ranks' shards, rank 0 commits (no volume needed, on any number of nodes); the
    credentials come from --env-secret's Secret by reference. None for a path."""
    if not is_url(chosen):
        return None
    if volume is not None:
        raise DdpkitError(
            f"--run-dir {chosen} and --volume {volume.claim}: a run in a bucket needs no volume; give one of them"
        )
    return chosen


def _pod_run_dir(chosen: str | None, volume: Volume | None, nodes: int, name: str) -> str:
    """The run directory, a path in the pods: on the shared volume, which a job on several nodes must
    have (each pod would otherwise write and resume from its own disk)."""
    if volume is None:
        if nodes > 1:
            raise DdpkitError(
                f"a {nodes}-node Kubernetes job needs its run directory on a volume every pod mounts: "
                "--volume PVC[:MOUNT] (a ReadWriteMany PersistentVolumeClaim; volume in [launch])"
            )
        if not chosen:
            raise DdpkitError("--run-dir: where the pod writes the run (a path in the pod; better on --volume PVC)")
        return chosen
    run_dir = PurePosixPath(chosen or f"{volume.mount}/runs/{name}")
    if not run_dir.is_absolute() or not run_dir.is_relative_to(volume.mount) or run_dir == PurePosixPath(volume.mount):
        raise DdpkitError(
            f"the run directory {run_dir} is not on the shared volume mounted at {volume.mount}: "
            f"choose --run-dir {volume.mount}/..., or mount the volume above it (--volume {volume.claim}:MOUNT)"
        )
    return str(run_dir)


def _procs(workers_per_node: int | None, gpus: int) -> int:
    if gpus and workers_per_node and workers_per_node > gpus:
        raise DdpkitError(
            f"--workers-per-node {workers_per_node} is more than --gpus-per-node {gpus}: ddpkit runs one worker "
            "per GPU; drop --workers-per-node"
        )
    return workers_per_node or gpus or 1


def _checked_name(value: str | None, what: str) -> str | None:
    if value is not None and not re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", value):
        raise DdpkitError(f"{what} {value!r} is not a Kubernetes name (lowercase letters, digits and '-')")
    return value


def _checked_accelerator(value: str | None) -> str | None:
    label, _, selected = (value or "").rpartition("=")
    if value is not None and not (_LABEL.match(selected) and (not label or _LABEL.match(label))):
        raise DdpkitError(f"--accelerator {value!r}: a node label's value (e.g. NVIDIA-H100-80GB-HBM3) or LABEL=VALUE")
    return value


def _at_least(value: int, least: int, flag: str) -> int:
    if value < least:
        raise DdpkitError(f"{flag} must be at least {least}, got {value}")
    return value


def pod_train_arguments(
    train_args: list[str] | None, config: str | None, parse_train: Callable[[list[str]], Any]
) -> tuple[list[str], Any, str | None]:
    """The arguments of `ddpkit train` every pod runs, what `parse_train` made of them (checked here,
    with the config file read from this machine), and that file (the pods read the ConfigMap's copy)."""
    args = list(train_args or ())
    given = config_of(args)
    if config and given:
        raise DdpkitError("--config given both before and after --: keep one")
    path = config or given
    here = _without_config(args)
    try:
        train = parse_train([*here, "--config", path] if path else here)
    except SystemExit:
        raise DdpkitError(
            "the training arguments are not valid `ddpkit train` arguments (see the message above)"
        ) from None
    for flag in placement_flags():
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise DdpkitError(
                f"{flag}: Kubeflow places the workers (its PET_* variables in every pod); use --nodes, "
                "--gpus-per-node and --workers-per-node of `ddpkit k8s`"
            )
    for name, value in getattr(train, "file_settings", {}).items():
        if name in SLURM_PLACES and value != FIELDS[name].default:
            raise DdpkitError(
                f"{name} = {value!r} in {path} does not belong in a Kubernetes job: Kubeflow places the workers "
                "(remove it; use --nodes / --gpus-per-node / --workers-per-node of `ddpkit k8s`)"
            )
    if path:
        here += ["--config", f"{CONFIG_MOUNT}/{Path(path).name}"]
    return here, train, path


def _without_config(args: list[str]) -> list[str]:
    """`args` less --config FILE / --config=FILE (the pods get the ConfigMap's path instead)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--config":
            skip = True
        elif not a.startswith("--config="):
            out.append(a)
    return out
