"""The guide's workload: sklearn's Wine data (178 samples, 13 features, 3 classes).

Exactly the guide's recipe: train_test_split(test_size=0.2, random_state=42), a
StandardScaler fit on the training split only, Linear(13,64)-ReLU-Linear(64,3), Adam lr
1e-3, cross-entropy. Every rank computes the same split and scaling (no randomness but the
fixed random_state), so nothing has to be broadcast.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..task import Task, accuracy_sum


def wine_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    data = load_wine()
    x_train, x_test, y_train, y_test = train_test_split(data.data, data.target, test_size=0.2, random_state=42)
    scaler = StandardScaler().fit(x_train)
    return (
        torch.tensor(scaler.transform(x_train), dtype=torch.float32),
        torch.tensor(y_train, dtype=torch.int64),
        torch.tensor(scaler.transform(x_test), dtype=torch.float32),
        torch.tensor(y_test, dtype=torch.int64),
    )


def wine_model() -> nn.Module:
    return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))


def build(config: Any = None) -> Task:
    x_train, y_train, x_test, y_test = wine_tensors()
    model = wine_model()
    return Task(
        model=model,
        train_set=TensorDataset(x_train, y_train),
        eval_set=TensorDataset(x_test, y_test),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        loss_fn=nn.CrossEntropyLoss(),
        metric=accuracy_sum,
    )
