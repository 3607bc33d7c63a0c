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
    """The guide's split and scaling, as float32/int64 tensors (equal to what sklearn's
    load_wine + train_test_split(test_size=0.2, random_state=42) + StandardScaler give;
    a test checks it). Reads sklearn's own wine_data.csv without importing sklearn (~1.3 s
    per process); falls back to sklearn when the file is not where it should be."""
    arrays = _wine_arrays_without_sklearn()
    if arrays is None:
        arrays = wine_arrays_sklearn()
    x_train, y_train, x_test, y_test = arrays
    return (
        torch.tensor(x_train, dtype=torch.float32),
        torch.tensor(y_train, dtype=torch.int64),
        torch.tensor(x_test, dtype=torch.float32),
        torch.tensor(y_test, dtype=torch.int64),
    )


def wine_arrays_sklearn() -> tuple[Any, Any, Any, Any]:
    """The guide's recipe, with sklearn itself."""
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    data = load_wine()
    x_train, x_test, y_train, y_test = train_test_split(data.data, data.target, test_size=0.2, random_state=42)
    scaler = StandardScaler().fit(x_train)
    return scaler.transform(x_train), y_train, scaler.transform(x_test), y_test


def _wine_arrays_without_sklearn() -> tuple[Any, Any, Any, Any] | None:
    import importlib.util
    import os

    import numpy as np

    try:
        spec = importlib.util.find_spec("sklearn")  # locates the package, imports nothing
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "wine_data.csv")
    try:
        with open(path) as f:
            n, n_features = (int(v) for v in f.readline().split(",")[:2])
            table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    except (OSError, ValueError):
        return None
    if table.shape != (n, n_features + 1):
        return None
    x, y = table[:, :-1], table[:, -1].astype(np.int64)
    # train_test_split(test_size=0.2, random_state=42) without stratify is ShuffleSplit:
    # one permutation from RandomState(42); the first ceil(0.2 n) are the test set.
    n_test = -(-n * 2 // 10)
    perm = np.random.RandomState(42).permutation(n)
    test, train = perm[:n_test], perm[n_test:]
    x_train, x_test = x[train], x[test]
    # StandardScaler: population std (ddof=0); a zero std is left as 1
    mean = x_train.mean(axis=0)
    std = np.sqrt(((x_train - mean) ** 2).mean(axis=0))
    std[std == 0.0] = 1.0
    return (x_train - mean) / std, y[train], (x_test - mean) / std, y[test]


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
