"""train_single.py distributed with ddpkit: the diff between the two is in docs/guide.md.

    ddpkit launch --nproc 2 examples/convert/train_ddp.py 100 50
    torchrun --nproc-per-node 2 examples/convert/train_ddp.py 100 50
    python examples/convert/train_ddp.py 100 50          # one process
"""
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.utils.data import Dataset

import ddpkit


class WineDataset(Dataset):
    def __init__(self, data, targets):
        self.data = data
        self.targets = targets

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return torch.tensor(self.data[idx], dtype=torch.float), torch.tensor(self.targets[idx], dtype=torch.long)


class SimpleNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(13, 64)
        self.fc2 = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class Trainer:
    def __init__(self, rt, model, train_data, optimizer, save_every):
        self.rt = rt
        self.model = rt.wrap(model)  # on this rank's device, in DDP when there are several ranks
        self.train_data = train_data
        self.optimizer = optimizer
        self.device = rt.device
        self.save_every = save_every

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.set_epoch(epoch)  # a new order every epoch, the same on every rank
        total_loss = 0.0
        for source, targets in self.train_data:
            total_loss += self._run_batch(source.to(self.device), targets.to(self.device))
        avg_loss = ddpkit.mean_across_ranks(total_loss / len(self.train_data))  # all ranks, not rank 0's shard
        self.rt.print(f"Epoch {epoch}, Loss: {avg_loss:.4f}")

    def _save_checkpoint(self, epoch):
        path = f"model_{epoch}.pt"
        self.rt.save(path, self.model, self.optimizer, epoch=epoch)  # rank 0, atomically, without `module.`
        self.rt.print(f"Epoch {epoch} | Model saved to {path}")

    def train(self, max_epochs):
        self.model.train()
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0:  # after epochs 10, 20, ...; never before training
                self._save_checkpoint(epoch + 1)


def load_train_objs(rt):
    wine = load_wine()
    x_train, x_test, y_train, y_test = train_test_split(wine.data, wine.target, test_size=0.2, random_state=42)
    scaler = StandardScaler().fit(x_train)
    train_set = WineDataset(scaler.transform(x_train), y_train)
    rt.print("A sample of the data set:", train_set[0])
    model = SimpleNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    return train_set, model, optimizer


def prepare_dataloader(rt, dataset, batch_size):
    return rt.loader(dataset, batch_size=batch_size)  # this rank's share of each global batch


def main(total_epochs, save_every, batch_size):
    with ddpkit.init() as rt:  # joins the job (ddpkit launch, torchrun, srun) or runs alone
        dataset, model, optimizer = load_train_objs(rt)
        train_data = prepare_dataloader(rt, dataset, batch_size)
        trainer = Trainer(rt, model, train_data, optimizer, save_every)
        trainer.train(total_epochs)
        del trainer, model, optimizer  # release what holds the process group before it goes


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple training job")
    parser.add_argument("total_epochs", type=int, help="epochs to train")
    parser.add_argument("save_every", type=int, help="save a checkpoint every N epochs")
    parser.add_argument("--batch_size", default=32, type=int, help="batch size per process (default 32)")
    args = parser.parse_args()
    main(args.total_epochs, args.save_every, args.batch_size)
