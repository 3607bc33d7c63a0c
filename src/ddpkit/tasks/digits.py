"""A small CNN on sklearn's bundled 8x8 handwritten digits (no download): real deep learning
in miniature, with the same guarantees as Wine (same model at any --nproc, exact eval).

1,797 grey-scale images, 10 classes; a fixed stratified split (test_size=0.2,
random_state=42): 1,437 training and 360 test images, pixels scaled from 0..16 to 0..1.
Conv(1->16) -> ReLU -> MaxPool -> Conv(16->32) -> ReLU -> MaxPool -> Linear(128->10), Adam
lr 1e-2, cross-entropy. Reaches ~0.97 test accuracy in 8 epochs on 2 processes.

No dropout and no batch norm on purpose: dropout draws per-rank random masks and batch norm
uses per-rank batch statistics, so either would make 2 processes train a different model
than 1 process with the same global batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..task import Task, accuracy_sum


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test); images as float32 [N, 1, 8, 8] in 0..1."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.images, data.target, test_size=0.2, random_state=42, stratify=data.target
    )

    def images(x: Any) -> torch.Tensor:
        return torch.tensor(x / 16.0, dtype=torch.float32).unsqueeze(1)

    return (
        images(x_train),
        torch.tensor(y_train, dtype=torch.int64),
        images(x_test),
        torch.tensor(y_test, dtype=torch.int64),
    )


def digits_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16 x 4 x 4
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 32 x 2 x 2
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 10),
    )


def build(config: Any = None) -> Task:
    x_train, y_train, x_test, y_test = digits_tensors()
    return Task(
        model=digits_model(),
        train_set=TensorDataset(x_train, y_train),
        eval_set=TensorDataset(x_test, y_test),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss_fn=nn.CrossEntropyLoss(),
        metric=accuracy_sum,
    )
