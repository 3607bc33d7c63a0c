"""Run by a Python that has SkyPilot (test_skypilot.py): load each task YAML named on the command
line with SkyPilot's own loader (sky.Task.from_yaml: its YAML reader, its JSON schema of a task
and of resources, then Task, Resources, Storage and volume objects), and print, as one JSON line
per file, what SkyPilot made of it, or the loader's error."""

import json
import sys


def describe(task):
    from sky.utils import registry

    (res,) = list(task.resources)
    recovery = res.job_recovery
    strategy = recovery.get("strategy") if recovery else None
    return {
        "name": task.name,
        "num_nodes": task.num_nodes,
        "cloud": str(res.cloud).lower() if res.cloud else None,
        "accelerators": res.accelerators,
        "cpus": res.cpus,
        "memory": res.memory,
        "image_id": res.image_id,
        "job_recovery": recovery,
        # a strategy SkyPilot's managed jobs know (its client lets unknown names pass to the server)
        "strategy_known": strategy is None or registry.JOBS_RECOVERY_STRATEGY_REGISTRY.from_str(strategy) is not None,
        "storage": {
            path: {"name": s.name, "source": s.source, "mode": s.mode.value} for path, s in task.storage_mounts.items()
        },
        "file_mounts": task.file_mounts,
        "volumes": task.volumes,
        "workdir": task.workdir,
        "setup": task.setup,
        "run": task.run,
        # a null secret is a reference resolved at launch (sky jobs launch --secret NAME), never a value
        "secrets": {k: v.get_secret_value() for k, v in (task.secrets or {}).items()},
        "secret_refs": [ref.name for ref in getattr(task, "_managed_secret_refs", [])],
    }


def main(paths):
    import sky

    for path in paths:
        try:
            out = {"ok": True, **describe(sky.Task.from_yaml(path))}
        except Exception as e:  # the loader's refusal is the result
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
