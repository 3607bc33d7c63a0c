"""The built-in digits task (same data, CNN and Adam) in float64, for the test that 2
processes train the model 1 process trains with the same global batch. That claim is about
the mechanism (the same samples in the same global batches, each weighted by its share):
in float32 the two differ by rounding of another summation order, which Adam amplifies
(README, "Same result at any world size"); in float64 that rounding is ~1e-16 and stays far
below anything a wrong sample or weight would change."""
import dataclasses

from torch.utils.data import TensorDataset

from ddpkit.tasks.digits import build as digits


def build(config=None):
    task = digits(config)
    x, y = task.train_set.tensors
    eval_x, eval_y = task.eval_set.tensors
    return dataclasses.replace(task, model=task.model.double(), train_set=TensorDataset(x.double(), y),
                               eval_set=TensorDataset(eval_x.double(), eval_y))
