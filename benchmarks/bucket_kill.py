#!/usr/bin/env python
"""kill -9 of the launcher at random moments of its uploads to a bucket, then --auto-resume,
again and again: every restart must continue from the newest committed checkpoint (the
newest manifest in the bucket when the launcher died), and the final model.pt must equal an
uninterrupted run's (on a local disk) within 1e-6.

    python benchmarks/bucket_kill.py [--kills 10] [--seed 0] [--out benchmarks/results/bucket_kill.md]

The server is moto's S3-compatible one, on loopback, in this process: it sees every request,
and at the k-th PUT of a checkpoint upload (k drawn at random) kills the launcher's process group with
SIGKILL and drops that request unstored (what was being sent when the pod died never arrives).
The run: Wine, FSDP on 2 CPU processes, float64, a checkpoint every epoch (each: two ranks'
shards, rank 1's report, rank 0's .metadata, ddpkit.pt and manifest, then the run's files).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ARGS = ("--nproc", "2", "--strategy", "fsdp", "--seed", "5", "--epochs", "12", "--save-every", "1")


class Server:
    """moto's server, each request first shown to `on_put(path)`: a true answer drops it."""

    def __init__(self) -> None:
        import logging

        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.on_put = lambda path: False
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        wsgi = self.server._server
        served = wsgi.app

        def hooked(environ, start_response):
            if environ["REQUEST_METHOD"] == "PUT" and self.on_put(environ.get("PATH_INFO", "")):
                start_response("503 Service Unavailable", [("Content-Length", "0")])
                return [b""]
            return served(environ, start_response)

        wsgi.app = hooked
        host, port = self.server.get_host_and_port()
        self.env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "k",
                    "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
        self.client = boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                                   aws_access_key_id="k", aws_secret_access_key="s")  # fmt: skip

    def committed(self, bucket: str, prefix: str) -> list[str]:
        got = self.client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/checkpoints/").get("Contents", [])
        names = [o["Key"].rsplit("/", 1)[-1].removesuffix(".manifest.json") for o in got]
        return sorted(n for n, o in zip(names, got, strict=True) if o["Key"].endswith(".manifest.json"))


def launch(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bucket_kill.md"))
    ns = p.parse_args()
    rng, s3 = random.Random(ns.seed), Server()
    s3.client.create_bucket(Bucket="kill")
    url, rows, start = "s3://kill/run", [], time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**s3.env, "TMPDIR": tmp}
        local = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        ref = subprocess.run([sys.executable, "-m", "ddpkit", "train", *ARGS, "--run-dir", f"{tmp}/ref"],
                             env=local, capture_output=True, text=True)  # fmt: skip
        assert ref.returncode == 0, ref.stdout + ref.stderr
        reference = torch.load(f"{tmp}/ref/model.pt", weights_only=True)
        expected = None  # the checkpoint the next start must resume from
        for attempt in range(ns.kills + 1):
            k, count, killed = rng.randint(1, 14), [0], []
            proc = launch([*ARGS, "--auto-resume", "--run-dir", url], env)

            def on_put(path: str, proc=proc, k=k, count=count, killed=killed, last=attempt == ns.kills) -> bool:
                if "/kill/run/checkpoints/" not in path or killed or last:
                    return False
                count[0] += 1
                if count[0] < k:
                    return False
                killed.append(path.split("/kill/run/")[-1])
                os.killpg(proc.pid, signal.SIGKILL)
                return True

            s3.on_put = on_put
            out, _ = proc.communicate(timeout=300)
            s3.on_put = lambda path: False
            m = re.search(r"resuming from s3://kill/run/checkpoints/(\S+)", out)
            resumed = m.group(1) if m else None
            assert resumed == expected, (
                f"start {attempt}: resumed from {resumed}, newest committed {expected}: {out[-2000:]}"
            )
            newest = (s3.committed("kill", "run") or [None])[-1]
            rows.append((attempt, resumed or "-", f"PUT #{k}: {killed[0]}" if killed else "-", newest or "-"))
            print(rows[-1], flush=True)
            if not killed:
                assert proc.returncode == 0, out
                break
            expected = newest
        model = torch.load(io.BytesIO(s3.client.get_object(Bucket="kill", Key="run/model.pt")["Body"].read()),
                           weights_only=True)  # fmt: skip
        diff = max((model[n].double() - reference[n].double()).abs().max().item() for n in reference)
    s3.server.stop()
    kills = sum(1 for r in rows if r[2] != "-")
    assert diff <= 1e-6, diff
    text = "\n".join([
        "# kill -9 during uploads to a bucket, then --auto-resume",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores: {kills} kills of the launcher "
        f"at random PUTs (seed {ns.seed}), {time.monotonic() - start:.0f} s in all. Every start resumed from the "
        f"newest committed checkpoint; final model.pt vs an uninterrupted local run: max |diff| = {diff:.1e}.",
        f"`python benchmarks/bucket_kill.py --kills {ns.kills} --seed {ns.seed}`",
        "",
        "| start | resumed from | killed at (the PUT dropped) | newest committed after |",
        "|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
        "",
    ])  # fmt: skip
    Path(ns.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
