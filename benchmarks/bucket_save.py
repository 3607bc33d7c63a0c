#!/usr/bin/env python
"""Checkpoints to a bucket, blocking vs --async-save: how long the training step waits for a
save (the ledger's `checkpoint` part, the mean of the ranks) when the run folder is
s3://bench/... on an S3-compatible server on loopback (moto's, started here; in memory).

    python benchmarks/bucket_save.py [--rounds 3] [--steps 30] [--out benchmarks/results/bucket_save.md]

The 9.46M-parameter MLP of checkpoint_save.py (SGD with momentum: ~76 MB a checkpoint), 2 CPU
processes, DDP (one file, uploaded by rank 0), a checkpoint every 5 optimizer steps, rounds
interleaved. Blocking: the step waits for the write and the upload; async: for the CPU copy
only, the write, the upload and the commit (the manifest) run behind. The ledger's part also
holds the final model.pt, written the same way by every variant: a third, `none` (no
checkpoint, model.pt only), measures it, and the checkpoints' wait is each variant's part less
none's. Loopback has no network latency: a real bucket makes the blocking save slower, not the
async step's wait.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

VARIANTS = ("none", "blocking", "async")


def start_server() -> tuple[object, dict[str, str], object]:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")  # fmt: skip
    client.create_bucket(Bucket="bench")
    return server, env, client


def run(variant: str, steps: int, n: int, env: dict[str, str], client) -> dict:
    prefix = f"run-{n}"
    argv = [
        "{python}", "-m", "ddpkit", "train", f"{ROOT}/benchmarks/tasks/mlp.py:build_momentum",
        "--nproc", "2", "--batch-size", "256", "--max-steps", str(steps),
        "--save-every", "0", "--quiet", "--run-dir", f"s3://bench/{prefix}",
    ] + (["--save-every-steps", "5"] if variant != "none" else [])  # fmt: skip
    argv += ["--async-save"] if variant == "async" else []
    full = {
        **env,
        "PYTHONPATH": str(ROOT / "src"),
        "BENCH_MLP_SAMPLES": str(steps * 2 * 256),
        "DDPKIT_BENCH_RESULT": "1",
    }
    res = harness.require(harness.run_cmd(variant, argv, full, timeout=900))
    summary = json.loads(client.get_object(Bucket="bench", Key=f"{prefix}/summary.json")["Body"].read())
    seconds = summary["time"]["seconds"]
    keys = client.list_objects_v2(Bucket="bench", Prefix=f"{prefix}/checkpoints/").get("Contents", [])
    manifests = [k for k in keys if k["Key"].endswith(".manifest.json")]
    for k in keys:  # the server keeps everything in memory
        client.delete_object(Bucket="bench", Key=k["Key"])
    return {"variant": variant, "wait_s": seconds["checkpoint"], "wall_s": res["wall_s"], "committed": len(manifests)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bucket_save.md"))
    ns = p.parse_args()
    server, env, client = start_server()
    load_before = os.getloadavg()
    results = []
    try:
        for n, (r, variant) in enumerate(harness.interleave(VARIANTS, ns.rounds)):
            results.append(run(variant, ns.steps, n, env, client))
            print(f"round {r + 1}: {results[-1]}", flush=True)
    finally:
        server.stop()
    load_after = os.getloadavg()
    medians, rows = {}, []
    for variant in VARIANTS:
        runs = [x for x in results if x["variant"] == variant]
        medians[variant] = statistics.median(x["wait_s"] for x in runs)
        rows.append([variant, harness.spread([x["wait_s"] for x in runs], ".3f"),
                     harness.spread([x["wall_s"] for x in runs], ".1f"), runs[0]["committed"]])  # fmt: skip
    final = medians["none"]  # model.pt alone
    ratio = (medians["async"] - final) / (medians["blocking"] - final)
    text = "\n".join(
        [
            "# Checkpoints to a bucket: blocking vs --async-save",
            "",
            f"{harness.measured(load_before, load_after)}; {ns.rounds} interleaved rounds, "
            f"{ns.steps} optimizer steps, a checkpoint (~76 MB) every 5, to s3:// on moto's server on loopback.",
            f"`python benchmarks/bucket_save.py --rounds {ns.rounds} --steps {ns.steps}`",
            "",
            *harness.md_table(["variant", "step's wait for saves, s (median, range)", "wall s", "committed"], rows),
            "",
            f"the steps' wait for checkpoints (each variant's part less none's {final:.3f} s for the final "
            f"model.pt), async / blocking: {ratio:.3f}x; with model.pt counted in both: "
            f"{medians['async'] / medians['blocking']:.3f}x.",
            "",
        ]
    )
    Path(ns.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
