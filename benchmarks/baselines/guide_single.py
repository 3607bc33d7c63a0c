"""The guide's single-process Wine baseline (section 4 of shared/seed/README.md), copied
faithfully. Bench changes, each marked `# BENCH:`:
  * checkpoints go to --save-dir / $BENCH_SAVE_DIR (a fresh temp dir by default), not cwd;
  * an evaluation pass over the test split at the end, printing the test accuracy;
  * a final `RESULT {json}` line (train_s = time inside trainer.train()).
Everything else -- including the guide's `epoch % save_every == 0` (saves at epochs 0 and
50), per-item torch.tensor() in __getitem__, pin_memory=True and default threads -- is as
written.

    python benchmarks/baselines/guide_single.py [--save-dir DIR]
"""

import time

_T0 = time.perf_counter()  # BENCH: in-process wall clock starts before the imports

import argparse  # BENCH
import atexit  # BENCH
import json  # BENCH
import os  # BENCH
import shutil  # BENCH
import tempfile  # BENCH

import numpy as np  # noqa: F401  (as in the guide)
import torch
import torch.nn.functional as F
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.utils.data import DataLoader, Dataset

SAVE_DIR = "."  # BENCH: set in __main__


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
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return x


class Trainer:
    def __init__(self, model, train_data, optimizer, gpu_id, save_every):
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.gpu_id = gpu_id
        self.save_every = save_every
        self.losses = []

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        total_loss = 0.0
        num_batches = len(self.train_data)
        for source, targets in self.train_data:
            source = source.to(self.gpu_id)
            targets = targets.to(self.gpu_id)
            loss = self._run_batch(source, targets)
            total_loss += loss
        avg_loss = total_loss / num_batches
        self.losses.append(avg_loss)
        print(f"Epoch {epoch}, Loss: {avg_loss:.4f}")

    def _save_checkpoint(self, epoch):
        checkpoint = self.model.state_dict()
        PATH = os.path.join(SAVE_DIR, f"model_{epoch}.pt")  # BENCH: was f"model_{epoch}.pt" (cwd)
        torch.save(checkpoint, PATH)
        print(f"Epoch {epoch} | Model saved to {PATH}")

    def train(self, max_epochs):
        self.model.train()
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def load_train_objs():
    wine_data = load_wine()
    X = wine_data.data
    y = wine_data.target
    # Normalize and split
    X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.2, random_state=42)
    scaler = StandardScaler().fit(X_train)
    X_train = scaler.transform(X_train)
    X_test = scaler.transform(X_test)
    train_set = WineDataset(X_train, y_train)
    test_set = WineDataset(X_test, y_test)
    print("Dataset sample:")
    sample_data, sample_target = train_set[0]
    print(f"Data: {sample_data}")
    print(f"Target: {sample_target}")
    model = SimpleNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    return train_set, model, optimizer, test_set  # BENCH: also returns test_set for the eval pass


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=True, shuffle=True)


def evaluate(model, test_set, device):  # BENCH: added evaluation pass
    model.eval()
    correct = 0
    with torch.no_grad():
        for source, targets in DataLoader(test_set, batch_size=len(test_set)):
            correct += (model(source.to(device)).argmax(1) == targets.to(device)).sum().item()
    acc = correct / len(test_set)
    print(f"Test accuracy: {acc:.4f}")
    return acc


def main(device, total_epochs, save_every, batch_size):
    dataset, model, optimizer, test_set = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, device, save_every)
    t = time.perf_counter()  # BENCH
    trainer.train(total_epochs)
    train_s = time.perf_counter() - t  # BENCH
    acc = evaluate(model, test_set, device)  # BENCH
    print(
        "RESULT "
        + json.dumps(
            {  # BENCH
                "world_size": 1,
                "threads": torch.get_num_threads(),
                "samples_per_s": total_epochs * len(dataset) / train_s,
                "train_s": train_s,
                "wall_s": time.perf_counter() - _T0,
                "final_loss": trainer.losses[-1],
                "test_acc": acc,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":  # BENCH: the guide calls main() at module level; same call
    parser = argparse.ArgumentParser(description="guide's single-process Wine baseline")
    parser.add_argument("--save-dir", default=os.environ.get("BENCH_SAVE_DIR"))
    args = parser.parse_args()
    SAVE_DIR = args.save_dir or tempfile.mkdtemp(prefix="guide_single_")
    if not args.save_dir:  # BENCH: remove only the folder made here, at exit
        atexit.register(shutil.rmtree, SAVE_DIR, ignore_errors=True)
    os.makedirs(SAVE_DIR, exist_ok=True)
    main(
        device=torch.device("cuda:0" if torch.cuda.is_available() else "cpu"),
        total_epochs=100,
        save_every=50,
        batch_size=32,
    )
