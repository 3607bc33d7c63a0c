"""`ddpkit k8s`: write a Kubeflow Trainer v2 TrainJob (or a v1 PyTorchJob) that runs `ddpkit train`
in one pod per node. What goes into the job is engines/kubernetes.py's, its YAML
engines/trainjob.py's; here the flags and the help."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .flags import ENGINE_RULE
from .options import option
from .parser import Command
from .train_cmd import engine_command

K8S_HELP = f"""Write the Kubernetes job that runs `ddpkit train` on N nodes: a Kubeflow Trainer v2
TrainJob (with the TrainingRuntime it runs on), or a v1 PyTorchJob with --pytorchjob, built and
checked with Kubeflow's own API models. One pod per node, one worker per GPU; the run directory on a
shared volume. An evicted pod (SIGTERM) makes every rank save at the next step; every pod exits 143,
the job is started again and continues from that checkpoint. Example:

  ddpkit k8s --nodes 2 --gpus-per-node 8 --image registry/ddpkit:1 --volume runs --dry-run -- wine

{ENGINE_RULE}
"""


@dataclass(frozen=True)
class K8sOptions:
    nodes: int | None = option(help="nodes (pods) of the job", type=int, default_help="[launch] nodes, or 1")
    gpus_per_node: int | None = option(
        help="GPUs per node; one worker per GPU", type=int, default_help="[launch] gpus_per_node, or 0: CPU nodes"
    )
    workers_per_node: int | None = option(
        help="workers per pod on CPU nodes", type=int, default_help="[launch] workers_per_node, GPUs per node, or 1"
    )
    cpus_per_worker: int | None = option(
        help="CPU cores each worker asks for (the pod requests workers x this)",
        type=int,
        default_help="[launch] cpus_per_worker",
    )
    memory: str | None = option(help="memory per pod, e.g. 64GiB", default_help="[launch] memory")
    time: str | None = option(
        help="the job's time limit (its activeDeadlineSeconds), e.g. 04:00:00", default_help="[launch] time"
    )
    image: str | None = option(
        help="the container image, with ddpkit and the task installed", default_help="[launch] image"
    )
    namespace: str | None = option(
        help="the Kubernetes namespace", default_help="[launch] namespace, or the current one"
    )
    volume: str | None = option(
        help="PVC[:MOUNT]: a PersistentVolumeClaim every pod mounts (ReadWriteMany), for the run directory",
        default_help="[launch] volume; MOUNT: /mnt/PVC",
    )
    accelerator: str | None = option(
        help="the GPU type: the value of the node label nvidia.com/gpu.product, or LABEL=VALUE",
        default_help="[launch] accelerator",
    )
    run_dir: str | None = option(
        help="the run directory: a path in the pods (on --volume), or a bucket s3://BUCKET/PREFIX (its credentials "
        "by --env-secret)",
        default_help="[launch] run_dir, or MOUNT/runs/JOB_NAME",
    )
    env_secret: str | None = option(
        help="a Secret whose keys become every pod's environment (envFrom): the credentials of a bucket "
        "--run-dir s3://BUCKET/PREFIX (AWS_ACCESS_KEY_ID, ...), a job token (DDPKIT_JOB_TOKEN); referenced, never "
        "written into the YAML",
        metavar="SECRET",
    )
    job_name: str | None = option(
        help="the TrainJob's name (lowercase, at most 40 characters)", default_help="[launch] job_name, or ddpkit-TIME"
    )
    grace_period: int = option(
        300,
        "seconds an evicted pod has to save before it is killed (terminationGracePeriodSeconds): more than "
        "a checkpoint takes",
        type=int,
    )
    max_restarts: int = option(
        5, "times the job is started again after a pod failed or was evicted (JobSet maxRestarts)", type=int
    )
    pytorchjob: bool = option(False, "write a Kubeflow training-operator v1 PyTorchJob instead of a TrainJob")
    output: str | None = option(help="where to write the YAML", default_help="JOB_NAME.yaml")
    dry_run: bool = option(False, "print the YAML; write nothing")
    config: str | None = option(
        help="the training settings from a TOML, YAML or JSON file: checked now, carried to the pods by a "
        "ConfigMap and read by `ddpkit train --config` there; its [launch] table describes the job "
        "(the flags of `ddpkit k8s` win over it)",
        metavar="FILE",
    )


def cmd_k8s(ns: argparse.Namespace) -> int:
    from ..engines.trainjob import k8s_command

    return engine_command(k8s_command, ns)


COMMAND = Command(
    cmd_k8s,
    "write a Kubeflow TrainJob (or PyTorchJob) that runs `ddpkit train` on N nodes of Kubernetes",
    K8S_HELP,
    options=K8sOptions,
    formatter=argparse.RawDescriptionHelpFormatter,
    engine=True,
)
