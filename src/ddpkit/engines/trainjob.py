"""The YAML of a KubeJob (engines/kubernetes.py), built with Kubeflow's own API models and checked
by them: Kubeflow Trainer v2 (`kubeflow-trainer-api`: a TrainingRuntime with the pods' template and
a TrainJob that runs on it) or, with --pytorchjob, a training-operator v1 PyTorchJob (`kubeflow-training`).
Each document is parsed back into its model and must come out unchanged: a field the model does not
know (a misspelt key) would otherwise be dropped by the cluster without a word. `k8s_command`:
`ddpkit k8s` from its options to the YAML printed or written."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from ..errors import DdpkitError
from .kubernetes import CONFIG_MOUNT, KubeJob, kube_job

TRAINER_API = "trainer.kubeflow.org"
NODE = "node"  # the replicated job and container Trainer's torch runtime fills in (PET_*, its DNS name)
ANCESTOR = {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}


def _models(package: str, extra: str) -> Any:
    try:
        if package == "kubeflow_trainer_api":
            from kubeflow_trainer_api import models
        else:
            from kubeflow.training import models
    except ImportError:
        raise DdpkitError(f"this needs Kubeflow's API models: pip install 'ddpkit[{extra}]'") from None
    return models


def trainjob_documents(job: KubeJob) -> list[dict[str, Any]]:
    """The ConfigMap (with a --config file), the TrainingRuntime and the TrainJob, in that order."""
    m = _models("kubeflow_trainer_api", "k8s")
    meta = {"name": job.name, **({"namespace": job.namespace} if job.namespace else {})}
    runtime = m.TrainerV1alpha1TrainingRuntime(
        api_version=f"{TRAINER_API}/v1alpha1",
        kind="TrainingRuntime",
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta.from_dict(
            {**meta, "labels": {"trainer.kubeflow.org/framework": "torch"}}
        ),
        spec=m.TrainerV1alpha1TrainingRuntimeSpec(
            ml_policy=m.TrainerV1alpha1MLPolicy(num_nodes=job.nodes, torch=m.TrainerV1alpha1TorchMLPolicySource()),
            template=m.TrainerV1alpha1JobSetTemplateSpec(
                spec=m.JobsetV1alpha2JobSetSpec(
                    # a failed pod (an evicted one exits 143) fails its Job, and the JobSet starts every pod again
                    failure_policy=m.JobsetV1alpha2FailurePolicy(max_restarts=job.max_restarts),
                    replicated_jobs=[
                        m.JobsetV1alpha2ReplicatedJob(
                            name=NODE,
                            replicas=1,
                            template=m.IoK8sApiBatchV1JobTemplateSpec.from_dict(
                                {"metadata": {"labels": ANCESTOR}, "spec": _job_spec(job)}
                            ),
                        )
                    ],
                )
            ),
        ),
    )
    trainer = m.TrainerV1alpha1Trainer(
        image=job.image,
        command=job.command,
        num_nodes=job.nodes,
        num_proc_per_node=job.procs,
        env=[m.IoK8sApiCoreV1EnvVar(name="PYTHONUNBUFFERED", value="1")],
        resources_per_node=m.IoK8sApiCoreV1ResourceRequirements.from_dict(job.resources) if job.resources else None,
    )
    train_job = m.TrainerV1alpha1TrainJob(
        api_version=f"{TRAINER_API}/v1alpha1",
        kind="TrainJob",
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta.from_dict(meta),
        spec=m.TrainerV1alpha1TrainJobSpec(
            runtime_ref=m.TrainerV1alpha1RuntimeRef(api_group=TRAINER_API, kind="TrainingRuntime", name=job.name),
            trainer=trainer,
            active_deadline_seconds=job.deadline_s,
        ),
    )
    docs = [_config_map(job, m)] if job.config_text is not None else []
    docs += [_checked(runtime.to_dict(), type(runtime)), _checked(train_job.to_dict(), type(train_job))]
    return docs


def _job_spec(job: KubeJob) -> dict[str, Any]:
    """The Job of every node: one pod, never restarted in place (the JobSet restarts them all)."""
    return {"backoffLimit": 0, "template": {"spec": _pod_spec(job, NODE, "Never")}}


def _pod_spec(job: KubeJob, container: str, restart: str | None) -> dict[str, Any]:
    """A node's pod: its container (image, command, resources), the shared volume and the config
    file mounted, on the accelerator asked for, and the grace period a checkpoint needs."""
    mounts, volumes = [], []
    if job.volume is not None:
        mounts.append({"name": "run-volume", "mountPath": job.volume.mount})
        volumes.append({"name": "run-volume", "persistentVolumeClaim": {"claimName": job.volume.claim}})
    if job.config_text is not None:
        mounts.append({"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": job.config_map}})
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": job.grace_period_s,
        "containers": [
            {
                "name": container,
                "image": job.image,
                "command": job.command,
                **({"resources": job.resources} if job.resources else {}),
                **({"volumeMounts": mounts} if mounts else {}),
                **({"envFrom": [{"secretRef": {"name": job.env_secret}}]} if job.env_secret else {}),
            }
        ],
    }
    if restart:
        spec["restartPolicy"] = restart
    if volumes:
        spec["volumes"] = volumes
    if job.node_selector:
        spec["nodeSelector"] = job.node_selector
    return spec


def _config_map(job: KubeJob, m: Any) -> dict[str, Any]:
    meta = {"name": job.config_map, **({"namespace": job.namespace} if job.namespace else {})}
    doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {job.config_file: job.config_text}}
    return _checked(doc, m.IoK8sApiCoreV1ConfigMap)


def _checked(doc: dict[str, Any], model: Any) -> dict[str, Any]:
    """`doc` as `model` reads it back: the same, or an internal error naming what it dropped."""
    again = model.from_dict(doc).to_dict()
    if again != doc:
        raise AssertionError(f"{model.__name__} does not read back what ddpkit wrote: {doc!r} -> {again!r}")
    return doc


def pytorchjob_documents(job: KubeJob) -> list[dict[str, Any]]:
    """A training-operator v1 PyTorchJob: a Master pod and N-1 Worker pods, each `ddpkit train` with
    PET_* from the operator (nprocPerNode). Restart policy ExitCode: an evicted pod (143) is started again."""
    m = _models("kubeflow.training", "pytorchjob")
    from kubeflow.training import ApiClient
    from kubernetes.client import V1ConfigMap, V1ObjectMeta, V1PodTemplateSpec

    client = ApiClient()

    def replicas(n: int) -> Any:
        wanted = _pod_spec(job, "pytorch", None)
        pod = client._ApiClient__deserialize(wanted, "V1PodSpec")  # the kubernetes client's models check it
        if client.sanitize_for_serialization(pod) != wanted:
            raise AssertionError(f"V1PodSpec does not read back what ddpkit wrote: {wanted!r}")
        return m.KubeflowOrgV1ReplicaSpec(replicas=n, restart_policy="ExitCode", template=V1PodTemplateSpec(spec=pod))

    specs = {"Master": replicas(1), **({"Worker": replicas(job.nodes - 1)} if job.nodes > 1 else {})}
    pytorchjob = m.KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1",
        kind="PyTorchJob",
        metadata=V1ObjectMeta(name=job.name, namespace=job.namespace),
        spec=m.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(job.procs),
            pytorch_replica_specs=specs,
            run_policy=m.KubeflowOrgV1RunPolicy(backoff_limit=job.max_restarts, active_deadline_seconds=job.deadline_s),
        ),
    )
    docs = []
    if job.config_text is not None:
        meta = V1ObjectMeta(name=job.config_map, namespace=job.namespace)
        data = {job.config_file: job.config_text}
        docs.append(V1ConfigMap(api_version="v1", kind="ConfigMap", metadata=meta, data=data))
    return [client.sanitize_for_serialization(d) for d in [*docs, pytorchjob]]


def render(docs: list[dict[str, Any]], header: str = "") -> str:
    """The documents as one YAML stream, `header` as a comment on top."""
    import yaml

    text = yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, width=1000)
    lines = [f"# {line}" for line in header.splitlines()] if header else []
    return "\n".join([*lines, text]) if lines else text


def k8s_command(
    opts: Any, command_line: str, parse_train: Callable[[list[str]], Any], train_config: Callable[[Any], Any]
) -> int:
    """`ddpkit k8s` with its options `opts`: the YAML printed (--dry-run) or written to a file, with
    the command that starts it. `command_line` heads the YAML as a comment."""
    job = kube_job(opts, parse_train, train_config)
    if job.volume is None and "://" not in job.run_dir:  # a bucket's run outlives the pod
        print(
            f"ddpkit: warning: the run directory {job.run_dir} is on the pod's own disk: an evicted pod's "
            "checkpoints go with it (--volume PVC keeps them)",
            file=sys.stderr,
            flush=True,
        )
    docs = pytorchjob_documents(job) if opts.pytorchjob else trainjob_documents(job)
    text = render(docs, f"written by {command_line}" if command_line else "")
    if opts.dry_run:
        print(text, end="")
        return 0
    out = Path(opts.output or f"{job.name}.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    part.write_text(text)
    os.replace(part, out)
    kind = "PyTorchJob" if opts.pytorchjob else "TrainJob"
    where = f" on volume {job.volume.claim}" if job.volume else ""
    print(
        f"ddpkit: wrote {out}: {kind} {job.name}, {job.nodes} pod(s) x {job.procs} worker(s), run directory "
        f"{job.run_dir}{where}; start it with: kubectl apply -f {shlex.quote(str(out))}"
    )
    return 0
