"""A user's own task for `ddpkit train examples/user_task.py:build`.

The function builds what the guide's `load_train_objs` builds; ddpkit does the rest
(processes, process group, sampler, device, checkpoints). It may take the RunConfig.
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def build(config=None):
    # A toy regression-like classification: 4 Gaussian blobs in 8 dimensions.
    g = torch.Generator().manual_seed(1234)
    centers = torch.randn(4, 8, generator=g) * 3
    labels = torch.randint(0, 4, (600,), generator=g)
    x = centers[labels] + torch.randn(600, 8, generator=g)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    return ddpkit.Task(
        model=model,
        train_set=TensorDataset(x[:500], labels[:500]),
        eval_set=TensorDataset(x[500:], labels[500:]),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        loss_fn=nn.CrossEntropyLoss(),  # accuracy is reported by default for cross-entropy
    )
