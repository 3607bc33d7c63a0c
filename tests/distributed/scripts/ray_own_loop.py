"""A user's own Ray Train job whose train function runs examples/own_loop.py, whose
ddpkit.init() joins the process group Ray made. Run as: python ray_own_loop.py ADDRESS SCRIPT EPOCHS OUT"""

import runpy
import sys

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def loop(config):
    import ddpkit

    env = ddpkit.DistEnv.detect()
    print(f"rank {env.rank} of {env.world_size}, placed by {env.launcher}", flush=True)
    sys.argv = [config["script"], "--epochs", config["epochs"], "--out", config["out"]]
    runpy.run_path(config["script"], run_name="__main__")


if __name__ == "__main__":
    address, script, epochs, out = sys.argv[1:]
    ray.init(address=address)
    TorchTrainer(
        loop,
        train_loop_config={"script": script, "epochs": epochs, "out": out},
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(storage_path=out, name="ray"),
    ).fit()
