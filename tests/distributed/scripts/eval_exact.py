"""Evaluate one fixed Wine model on the test split with ddpkit's exact sharded evaluation;
rank 0 writes {loss, accuracy, count} to the path given. Used by the tests at several world sizes."""
import json
import sys

import torch

import ddpkit
from ddpkit.strategies import DdpStrategy
from ddpkit.task import accuracy_sum
from ddpkit.tasks.wine import wine_model, wine_tensors
from ddpkit.training.evaluate import evaluate

with ddpkit.init() as rt:
    torch.manual_seed(0)
    model = wine_model()
    _, _, x_test, y_test = wine_tensors()
    ds = torch.utils.data.TensorDataset(x_test, y_test)
    res = evaluate(model, ds, torch.nn.functional.cross_entropy, accuracy_sum, "accuracy", rt, DdpStrategy(rt),
                   batch_size=4)
    if rt.is_main:
        json.dump(res, open(sys.argv[1], "w"))
