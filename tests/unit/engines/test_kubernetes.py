"""`ddpkit k8s` (engines/kubernetes.py, trainjob.py): the YAML it writes, parsed back and read
field by field (and by Kubeflow's own models), the job taken from a config file's [launch] table
under the command's flags, and what it refuses, each in one line before anything is written."""

import pytest
import yaml

from ddpkit.cli import main

pytest.importorskip("kubeflow_trainer_api")
from kubeflow_trainer_api import models  # noqa: E402

GPU_JOB = ["--nodes", "2", "--gpus-per-node", "8", "--image", "reg.example/ddpkit:1", "--volume", "runs:/shared"]


def _yaml(capsys, *argv):
    assert main(["k8s", *argv]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return list(yaml.safe_load_all(out)), out


def _refused(capsys, *argv):
    assert main(["k8s", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddpkit: error: "), err
    return err[0]


def _pod(runtime):
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return node, node["template"]["spec"]["template"]["spec"]


def test_a_trainjob_on_two_gpu_nodes_reads_back_field_by_field(capsys):
    docs, text = _yaml(capsys, *GPU_JOB, "--job-name", "wine-1", "--namespace", "ml", "--dry-run",
                       "--", "wine", "--epochs", "3")  # fmt: skip
    assert text.startswith("# written by ddpkit ")
    runtime, job = docs
    assert [d["kind"] for d in docs] == ["TrainingRuntime", "TrainJob"]
    assert runtime["apiVersion"] == job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert runtime["metadata"]["name"] == job["metadata"]["name"] == "wine-1"
    assert runtime["metadata"]["namespace"] == job["metadata"]["namespace"] == "ml"
    # the runtime: Trainer's torch policy (its PET_* in every pod), a JobSet that starts every pod again
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 2, "torch": {}}
    assert runtime["spec"]["template"]["spec"]["failurePolicy"] == {"maxRestarts": 5}
    node, pod = _pod(runtime)
    assert node["name"] == "node" and node["replicas"] == 1
    assert node["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert node["template"]["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == 300
    assert pod["volumes"] == [{"name": "run-volume", "persistentVolumeClaim": {"claimName": "runs"}}]
    (container,) = pod["containers"]
    assert container["name"] == "node" and container["volumeMounts"] == [{"mountPath": "/shared", "name": "run-volume"}]
    # the job: the runtime, the image, the command, a pod per node with a worker per GPU
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": "wine-1",
    }
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (2, 8, "reg.example/ddpkit:1")
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert trainer["command"] == container["command"] == [
        "python", "-m", "ddpkit", "train", "wine", "--epochs", "3", "--run-dir", "/shared/runs/wine-1",
        "--auto-resume", "--save-on-signal", "TERM",
    ]  # fmt: skip
    assert "activeDeadlineSeconds" not in job["spec"]
    # Kubeflow's models read both back unchanged
    assert models.TrainerV1alpha1TrainJob.from_dict(job).to_dict() == job
    assert models.TrainerV1alpha1TrainingRuntime.from_dict(runtime).to_dict() == runtime


def test_the_launch_table_describes_the_job_and_the_flags_win(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text(
        "epochs = 2\n[launch]\n"
        'nodes = 3\nworkers_per_node = 2\ncpus_per_worker = 4\nmemory = "8GiB"\nimage = "from-file:1"\n'
        'namespace = "team"\nvolume = "data:/data"\naccelerator = "NVIDIA-H100-80GB-HBM3"\nrun_dir = "/data/run"\n'
        'job_name = "from-file"\ntime = "01:30:00"\n'
    )
    docs, _ = _yaml(
        capsys, "--config", str(config), "--nodes", "2", "--job-name", "flag-wins", "--dry-run", "--", "wine"
    )
    config_map, runtime, job = docs
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"] == {
        "name": "flag-wins-config",
        "namespace": "team",
    }
    assert config_map["data"] == {"job.toml": config.read_text()}  # the pods read the file from here
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (2, 2, "from-file:1")
    assert trainer["resourcesPerNode"] == {
        "requests": {"cpu": "8", "memory": "8192Mi"},
        "limits": {"cpu": "8", "memory": "8192Mi"},
    }
    assert job["spec"]["activeDeadlineSeconds"] == 5400
    assert job["metadata"] == {"name": "flag-wins", "namespace": "team"}
    _, pod = _pod(runtime)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"name": "config", "configMap": {"name": "flag-wins-config"}} in pod["volumes"]
    assert {"mountPath": "/etc/ddpkit", "name": "config", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert trainer["command"][4:] == [
        "wine", "--config", "/etc/ddpkit/job.toml", "--run-dir", "/data/run",
        "--auto-resume", "--save-on-signal", "TERM",
    ]  # fmt: skip


def test_the_task_and_its_flags_after_dashes_and_the_yaml_is_written_to_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["k8s", "--nodes", "2", "--image", "img:2", "--volume", "pvc", "--grace-period", "900", "--job-name", "w2"]
    assert main([*argv, "--max-restarts", "9", "--accelerator", "a=b", "--", "wine", "--epochs", "4"]) == 0
    said = capsys.readouterr().out
    assert said.strip().endswith("start it with: kubectl apply -f w2.yaml"), said
    runtime, job = yaml.safe_load_all((tmp_path / "w2.yaml").read_text())
    _, pod = _pod(runtime)
    assert pod["terminationGracePeriodSeconds"] == 900 and pod["nodeSelector"] == {"a": "b"}
    assert runtime["spec"]["template"]["spec"]["failurePolicy"] == {"maxRestarts": 9}
    assert job["spec"]["trainer"]["command"][4:7] == ["wine", "--epochs", "4"]  # a train flag stays the task's
    assert "/mnt/pvc/runs/w2" in job["spec"]["trainer"]["command"]


def test_a_pytorchjob_with_a_master_and_workers(capsys):
    pytest.importorskip("kubeflow.training")
    (job,), _ = _yaml(capsys, *GPU_JOB, "--nodes", "3", "--job-name", "pj", "--pytorchjob", "--dry-run", "--", "wine")
    assert (job["apiVersion"], job["kind"], job["metadata"]) == ("kubeflow.org/v1", "PyTorchJob", {"name": "pj"})
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8" and spec["runPolicy"] == {"backoffLimit": 5}
    replicas = spec["pytorchReplicaSpecs"]
    assert {k: (v["replicas"], v["restartPolicy"]) for k, v in replicas.items()} == {
        "Master": (1, "ExitCode"),  # 143 after an eviction is retryable: the pod starts again
        "Worker": (2, "ExitCode"),
    }
    pod = replicas["Worker"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 300 and pod["containers"][0]["name"] == "pytorch"
    assert pod["containers"][0]["command"][-3:] == ["--auto-resume", "--save-on-signal", "TERM"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "2", "--image", "i"], "a 2-node Kubernetes job needs its run directory on a volume every pod "
         "mounts: --volume PVC[:MOUNT] (a ReadWriteMany PersistentVolumeClaim; volume in [launch])"),
        (["--image", "i", "--volume", "v:/shared", "--run-dir", "/elsewhere/run"],
         "the run directory /elsewhere/run is not on the shared volume mounted at /shared"),
        (["--volume", "v"], "the pods need a container image with ddpkit installed: --image IMAGE"),
        (["--image", "i", "--volume", "v", "--job-name", "Big_Name"], "job name 'Big_Name': use at most 40"),
        (["--image", "i", "--volume", "v", "--gpus-per-node", "2", "--workers-per-node", "4"],
         "--workers-per-node 4 is more than --gpus-per-node 2"),
        (["--image", "i", "--volume", "v", "--grace-period", "0"], "--grace-period must be at least 1, got 0"),
        (["--image", "i", "--volume", "v", "--", "wine", "--nnodes", "2"], "--nnodes: Kubeflow places the workers"),
        (["--image", "i", "--volume", "v", "--time", "soon"], "time 'soon' is not a time limit"),
    ],
)  # fmt: skip
def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert message in _refused(capsys, *argv if "--" in argv else [*argv, "--", "wine"])
    assert list(tmp_path.iterdir()) == []


def test_a_placement_setting_in_the_config_file_is_refused(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text("nproc = 4\n")
    line = _refused(capsys, "--config", str(config), "--image", "i", "--volume", "v", "--dry-run", "--", "wine")
    assert "nproc = 4 in" in line and "does not belong in a Kubernetes job" in line


def test_one_node_without_a_volume_is_written_with_a_warning(capsys):
    assert main(["k8s", "--image", "i", "--run-dir", "/tmp/run", "--dry-run", "--", "wine"]) == 0
    captured = capsys.readouterr()
    assert "ddpkit: warning: the run directory /tmp/run is on the pod's own disk" in captured.err
    runtime, job = yaml.safe_load_all(captured.out)
    assert "volumes" not in _pod(runtime)[1] and job["spec"]["trainer"]["numNodes"] == 1
