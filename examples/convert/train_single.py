"""The DDP guide's single-GPU Wine script, as a user has it before ddpkit (its code, its habits).

    python examples/convert/train_single.py 100 50

docs/guide.md shows the diff to train_ddp.py, the same script distributed with ddpkit.
"""
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.utils.data import DataLoader, Dataset


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
    def __init__(self, model, train_data, optimizer, device, save_every):
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        total_loss = 0.0
        for source, targets in self.train_data:
            total_loss += self._run_batch(source.to(self.device), targets.to(self.device))
        avg_loss = total_loss / len(self.train_data)
        print(f"Epoch {epoch}, Loss: {avg_loss:.4f}")

    def _save_checkpoint(self, epoch):
        path = f"model_{epoch}.pt"
        torch.save(self.model.state_dict(), path)
        print(f"Epoch {epoch} | Model saved to {path}")

    def train(self, max_epochs):
        self.model.train()
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def load_train_objs():
    wine = load_wine()
    x_train, x_test, y_train, y_test = train_test_split(wine.data, wine.target, test_size=0.2, random_state=42)
    scaler = StandardScaler().fit(x_train)
    train_set = WineDataset(scaler.transform(x_train), y_train)
    print("A sample of the data set:", train_set[0])
    model = SimpleNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)


def main(device, total_epochs, save_every, batch_size):
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, device, save_every)
    trainer.train(total_epochs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple training job")
    parser.add_argument("total_epochs", type=int, help="epochs to train")
    parser.add_argument("save_every", type=int, help="save a checkpoint every N epochs")
    parser.add_argument("--batch_size", default=32, type=int, help="batch size (default 32)")
    args = parser.parse_args()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    main(device, args.total_epochs, args.save_every, args.batch_size)
