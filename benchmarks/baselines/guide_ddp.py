"""The guide's one-node DDP Wine script (section 5 of shared/seed/README.md), as written,
made to run on a CPU-only machine. Bench changes, each marked `# BENCH:`:
  * backend "gloo" instead of "nccl", no torch.cuda.set_device(), DDP without device_ids,
    batches stay on the CPU (the guide moves them to cuda:<rank>);
  * MASTER_PORT: a free port picked by the parent instead of the fixed 12355;
  * world size: --nprocs (default 2) instead of torch.cuda.device_count();
  * checkpoints go to --save-dir / $BENCH_SAVE_DIR (fresh temp dir by default), not cwd;
  * rank 0 evaluates the test split at the end and prints a final `RESULT {json}` line
    (train_s = rank 0's time inside trainer.train(); final_loss = rank 0's last printed
    epoch loss, i.e. its own shard only, as the guide prints it).
Kept as written (these are the guide's bugs, on purpose): no sampler.set_epoch(), every
rank prints and every rank saves `module.`-prefixed checkpoints at epochs 0 and 50 to the
same path, default thread count (2 processes x 2 OpenMP threads on 2 cores).

    python benchmarks/baselines/guide_ddp.py 100 50 [--batch_size 32] [--nprocs 2]
"""

import time

_T0 = time.perf_counter()  # BENCH: in-process wall clock starts before the imports

import atexit  # BENCH
import json  # BENCH
import os
import shutil  # BENCH
import socket  # BENCH
import tempfile  # BENCH

import numpy as np  # noqa: F401  (as in the guide)
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cpu")  # BENCH: the guide uses cuda:<rank>


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


def ddp_setup(rank, world_size, port, save_dir):  # BENCH: + port, save_dir
    """
    Set up the distributed environment.
    rank: rank of this process; world_size: number of processes.
    """
    # Address of the main node: single-node training, so localhost.
    os.environ["MASTER_ADDR"] = "localhost"
    # Port the master listens on.
    os.environ["MASTER_PORT"] = str(port)  # BENCH: was "12355"
    os.environ["BENCH_SAVE_DIR"] = save_dir  # BENCH
    # Initialise the process group.
    init_process_group(backend="gloo", rank=rank, world_size=world_size)  # BENCH: was "nccl"
    # BENCH: torch.cuda.set_device(rank) removed (no GPU)


class Trainer:
    def __init__(self, model, train_data, optimizer, gpu_id, save_every):
        self.model = model.to(DEVICE)  # BENCH: was .to(gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.gpu_id = gpu_id
        self.save_every = save_every
        self.losses = []

        # This is the change
        self.model = DDP(self.model)  # BENCH: was DDP(self.model, device_ids=[gpu_id])

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
            source = source.to(DEVICE)  # BENCH: was .to(self.gpu_id)
            targets = targets.to(DEVICE)  # BENCH: was .to(self.gpu_id)
            loss = self._run_batch(source, targets)
            total_loss += loss
        avg_loss = total_loss / num_batches
        self.losses.append(avg_loss)
        print(f"Epoch {epoch}, Loss: {avg_loss:.4f}")

    def _save_checkpoint(self, epoch):
        checkpoint = self.model.state_dict()
        PATH = os.path.join(os.environ["BENCH_SAVE_DIR"], f"model_{epoch}.pt")  # BENCH: was cwd
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


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset, batch_size=batch_size, pin_memory=True, shuffle=False, sampler=DistributedSampler(dataset)
    )


def evaluate(model, test_set):  # BENCH: added evaluation pass (rank 0, whole test split)
    model.eval()
    correct = 0
    with torch.no_grad():
        for source, targets in DataLoader(test_set, batch_size=len(test_set)):
            correct += (model(source).argmax(1) == targets).sum().item()
    acc = correct / len(test_set)
    print(f"Test accuracy: {acc:.4f}")
    return acc


def main(rank: int, world_size: int, save_every: int, total_epochs: int, batch_size: int, port: int, save_dir: str):
    """Main training function of the DDP setup (one call per process)."""
    # Set up the distributed environment: master address, port and backend.
    ddp_setup(rank, world_size, port, save_dir)
    # Load the training objects (dataset, model, optimizer).
    dataset, model, optimizer, test_set = load_train_objs()
    # Data loader for distributed training: splits the data set across processes.
    train_data = prepare_dataloader(dataset, batch_size)
    # Trainer with the loaded model, data and settings.
    trainer = Trainer(model, train_data, optimizer, rank, save_every)
    # Train for the given number of epochs.
    t = time.perf_counter()  # BENCH
    trainer.train(total_epochs)
    train_s = time.perf_counter() - t  # BENCH
    if rank == 0:  # BENCH
        acc = evaluate(trainer.model.module, test_set)
        print(
            "RESULT "
            + json.dumps(
                {
                    "world_size": torch.distributed.get_world_size(),
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
    # Clean up the distributed environment once training is done.
    destroy_process_group()


def _free_port():  # BENCH
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="total number of epochs to train")
    parser.add_argument("save_every", type=int, help="how often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="input batch size per device (default: 32)")
    parser.add_argument(
        "--nprocs", default=2, type=int, help="BENCH: number of processes (guide: torch.cuda.device_count())"
    )
    parser.add_argument("--save-dir", default=os.environ.get("BENCH_SAVE_DIR"), help="BENCH: checkpoint directory")
    args = parser.parse_args()

    world_size = args.nprocs  # BENCH: was torch.cuda.device_count()
    save_dir = args.save_dir or tempfile.mkdtemp(prefix="guide_ddp_")  # BENCH
    if not args.save_dir:  # BENCH: remove only the folder made here, at exit
        atexit.register(shutil.rmtree, save_dir, ignore_errors=True)
    os.makedirs(save_dir, exist_ok=True)  # BENCH
    mp.spawn(
        main,
        args=(world_size, args.save_every, args.total_epochs, args.batch_size, _free_port(), save_dir),
        nprocs=world_size,
    )
