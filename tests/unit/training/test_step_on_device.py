"""A step without a host synchronisation (training/step.py, deferred.py): with an optimizer that
takes found_inf (torch's fused kernels, what --fused-optimizer auto builds on a GPU) the device
decides whether the weights move and the host reads the agreement one step later; without one
the host reads it at once. Counted on a CPU: every read of a tensor on the host during a step
(aten._local_scalar_dense, what .item()/float()/bool() run, and .tolist()/.cpu()/.numpy()) but
the pinned copy of the step before's flags, which on a GPU is host memory already. The other
paths (an optimizer without found_inf, fp16's gradient scaler, FSDP's shards: training/skipping.py)
are decided on the device of a GPU; on a CPU, where a read waits for nothing, only when asked
(device_decides), which these tests do to count them."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ddpkit import DdpkitError, DistEnv
from ddpkit.config import ON_NAN_MODES
from ddpkit.runtime import Runtime
from ddpkit.strategies import DdpStrategy
from ddpkit.training.step import StepRunner


@pytest.fixture
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


class HostReads(TorchDispatchMode):
    """Counts the host reads of tensors while active, except of the runner's flag copy."""

    def __init__(self, runner):
        super().__init__()
        self.runner, self.reads, self._saved = runner, [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self._step_count(args[0]):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))

    def _step_count(self, t):
        """torch's non-fused Adam reads its step count (`_get_value`): on a GPU a host tensor (no
        wait), or on the device under capturable (which skipping.py sets there, and a CPU refuses)."""
        return any(t is s.get("step") for s in self.runner.optimizer.state.values())

    def _wrap(self, name):
        original = self._saved[name] = getattr(torch.Tensor, name)

        def read(t, *a, **k):
            if t is not self.runner._host.buffer:
                self.reads.append(name)
            return original(t, *a, **k)

        setattr(torch.Tensor, name, read)

    def __enter__(self):
        for name in ("tolist", "cpu", "numpy"):
            self._wrap(name)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def _runner(rt, fused, on_nan="stop", opt="adamw", **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    if opt == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
    else:  # momentum under fused (its buffer is state), none otherwise (no state to read)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if fused else 0.0, fused=fused)
    return StepRunner(rt, DdpStrategy(rt), model, optimizer, nn.CrossEntropyLoss(), on_nan=on_nan, **kw)


def _batches(n, nan_at=None, size=6):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(1, n + 1):
        x, y = torch.randn(size, 3, generator=g), torch.randint(0, 2, (size,), generator=g)
        if i == nan_at:
            x[1, 0] = float("nan")
        out.append(((x, y), size, size))
    return out


def _weights(runner):
    return [p.detach().clone() for p in runner.model.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# torch's non-fused Adam reads its step count on the host (a CPU tensor on a GPU too): plain SGD reads nothing
@pytest.mark.parametrize("fused, opt, per_step", [(True, "adamw", 0), (True, "sgd", 0), (False, "sgd", 1)])
def test_a_step_reads_nothing_on_the_host_when_the_optimizer_takes_found_inf(rt, fused, opt, per_step):
    runner = _runner(rt, fused, opt=opt, accumulate=2, clip_grad_norm=0.5)  # clipping's norm stays on the device
    counts = []
    for i, (batch, n, g) in enumerate(_batches(6), start=1):
        with HostReads(runner) as mode:
            runner.run(batch, n, g, f"epoch 1, step {i}")
        counts.append(len(mode.reads))
    # the first step: the host decides (the optimizer's state is made then); a non-fused optimizer: every step
    assert counts == [1] + [per_step] * 5, counts
    assert runner.figures()["grad_norm"] > 0  # read on the host at the pass's end


def test_on_nan_has_the_modes_this_file_covers():
    assert set(ON_NAN_MODES) == {"stop", "skip"}  # a new mode needs its case below


@pytest.mark.parametrize("fused", [True, False], ids=["device decides", "host decides"])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_a_nan_at_step_k_leaves_the_weights_before_step_k_under_skip(rt, fused, opt):
    runner = _runner(rt, fused, on_nan="skip", opt=opt)
    weights, results = [], []
    for i, (batch, n, g) in enumerate(_batches(5, nan_at=3), start=1):
        weights.append(_weights(runner))
        results.append(runner.run(batch, n, g, f"epoch 1, step {i}"))
    after = _weights(runner)
    assert _same(weights[3], weights[2])  # step 3 (the NaN) left the weights as they were
    assert not _same(weights[4], weights[3]) and not _same(after, weights[4])  # the next steps train on
    assert all(torch.isfinite(p).all() for p in after)
    skipped = [r.skipped for r in results]
    assert skipped == ([0, 0, 0, 1, 0] if fused else [0, 0, 1, 0, 0])  # the device's: known a step later
    assert runner.settle() == 0
    assert results[2].loss_sum is None or results[2].loss_sum.tolist() == [0.0, 0.0]  # adds nothing to the pass
    if fused and opt == "adamw":  # skipped on the device: Adam's step count too
        assert all(s["step"].item() == 4 for s in runner.optimizer.state.values())


@pytest.mark.parametrize("fused", [True, False], ids=["device decides", "host decides"])
def test_a_nan_at_step_k_stops_naming_step_k_with_the_weights_before_it(rt, fused):
    runner = _runner(rt, fused, on_nan="stop")
    batches = _batches(5, nan_at=3)
    for i, (batch, n, g) in enumerate(batches[:2], start=1):
        runner.run(batch, n, g, f"epoch 1, step {i}")
    before = _weights(runner)
    with pytest.raises(DdpkitError, match=r"not finite in epoch 1, step 3 \(on 1 of 1 rank\(s\)\)"):
        runner.run(*batches[2], "epoch 1, step 3")
        assert fused  # the device skipped the update; the host says so at the end of the next step
        assert _same(_weights(runner), before)
        runner.run(*batches[3], "epoch 1, step 4")  # its update is skipped too: the run has stopped
    assert _same(_weights(runner), before)


@pytest.mark.parametrize("on_nan", ["stop", "skip"])
def test_a_nan_in_the_last_step_is_acted_on_when_the_pass_settles(rt, on_nan):
    runner = _runner(rt, True, on_nan=on_nan)
    batches = _batches(3, nan_at=3)
    for i, (batch, n, g) in enumerate(batches[:2], start=1):
        runner.run(batch, n, g, f"epoch 1, step {i}")
    before = _weights(runner)
    assert runner.run(*batches[2], "epoch 2, step 9").skipped == 0
    if on_nan == "stop":
        with pytest.raises(DdpkitError, match="not finite in epoch 2, step 9"):
            runner.settle()
    else:
        assert runner.settle() == 1 and runner.settle() == 0  # read once
    assert _same(_weights(runner), before)


class _Asked:
    received = None


@pytest.mark.parametrize("fused", [True, False])
def test_a_stop_asked_during_step_k_takes_effect_at_k_plus_one_when_the_device_decides(rt, fused):
    asked = _Asked()
    runner = _runner(rt, fused, stop=asked)
    results = []
    for i, (batch, n, g) in enumerate(_batches(4), start=1):
        asked.received = "SIGUSR1" if i == 3 else None
        results.append(runner.run(batch, n, g, f"epoch 1, step {i}"))
    assert [r.stop for r in results] == ([False, False, False, True] if fused else [False, False, True, False])


def _summed(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y, reduction="sum"), torch.tensor(float(len(y)))


@pytest.mark.parametrize("step_fn", [None, _summed], ids=["mean loss", "summed loss"])
def test_the_device_path_trains_bit_identically_to_the_host_path(rt, step_fn):
    device = _runner(rt, True, opt="sgd", accumulate=2, clip_grad_norm=0.3, step_fn=step_fn)
    host = _runner(rt, True, opt="sgd", accumulate=2, clip_grad_norm=0.3, step_fn=step_fn)
    host._how = "host"  # the same fused optimizer, decided on the host
    for i, (batch, n, g) in enumerate(_batches(5, size=7), start=1):
        a = device.run(batch, n, g, f"epoch 1, step {i}")
        b = host.run(batch, n, g, f"epoch 1, step {i}")
        assert torch.equal(a.loss_sum, b.loss_sum)
    assert _same(_weights(device), _weights(host))
    assert device.figures() == host.figures()


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)  # grows within the test's steps


# the paths that skip by a snapshot or the scaler's found_inf (training/skipping.py), counted on a CPU
@pytest.mark.parametrize(
    "fused, opt, scaled",
    [(False, "adamw", False), (False, "sgd", False), (True, "adamw", True), (False, "adamw", True)],
)
def test_the_other_paths_read_nothing_on_the_host_when_the_device_decides(rt, fused, opt, scaled):
    kw = {"scaler": _scaler()} if scaled else {}
    runner = _runner(rt, fused, opt=opt, accumulate=2, clip_grad_norm=0.5, device_decides=True, **kw)
    counts = []
    for i, (batch, n, g) in enumerate(_batches(6), start=1):
        with HostReads(runner) as mode:
            runner.run(batch, n, g, f"epoch 1, step {i}")
        counts.append(len(mode.reads))
    assert counts == [counts[0]] + [0] * 5 and counts[0] >= 1, counts
    assert runner._how == ("found_inf" if fused else "snapshot")
    if scaled:
        assert runner.scaler.get_scale() == 2.0**13  # three growths in six updates: the scaler ran on the device


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "fp16 scaler"])
def test_a_snapshot_or_scaled_step_is_bit_identical_to_the_host_and_skips_a_nan_as_it(rt, opt, scaled):
    runs = []
    for device_decides in (True, False):
        kw = {"scaler": _scaler()} if scaled else {}
        runner = _runner(rt, False, on_nan="skip", opt=opt, clip_grad_norm=0.3, device_decides=device_decides, **kw)
        weights, skipped = [], []
        for i, (batch, n, g) in enumerate(_batches(6, nan_at=3), start=1):
            weights.append(_weights(runner))
            skipped.append(runner.run(batch, n, g, f"epoch 1, step {i}").skipped)
        skipped[-1] += runner.settle()
        runs.append((runner, weights, skipped))
    (device, w_dev, s_dev), (host, w_host, _) = runs
    assert device._how == "snapshot" and host._how == "host"
    assert _same(w_dev[3], w_dev[2]) and not _same(w_dev[4], w_dev[3])  # the NaN step left the weights as they were
    assert s_dev == [0, 0, 0, 1, 0, 0]  # known a step later, as the fused path
    assert _same(_weights(device), _weights(host)) and _same(w_dev[4], w_host[4])
    if opt == "adamw":  # the skipped step's count was put back too
        assert all(s["step"].item() == 5 for s in device.optimizer.state.values())
    if scaled:  # the NaN step's overflow did not back the scale off (the host path does not update it)
        assert device.scaler.get_scale() == host.scaler.get_scale() == 2.0**12


def test_a_nan_stops_the_snapshot_path_naming_its_step_with_the_weights_before_it(rt):
    runner = _runner(rt, False, on_nan="stop", device_decides=True)
    batches = _batches(5, nan_at=3)
    for i, (batch, n, g) in enumerate(batches[:2], start=1):
        runner.run(batch, n, g, f"epoch 1, step {i}")
    before = _weights(runner)
    runner.run(*batches[2], "epoch 1, step 3")  # decided on the device: raised a step later
    assert _same(_weights(runner), before)
    with pytest.raises(DdpkitError, match=r"not finite in epoch 1, step 3"):
        runner.run(*batches[3], "epoch 1, step 4")
    assert _same(_weights(runner), before)  # step 4's update skipped too: the run had stopped


@pytest.fixture
def fsdp_rt():
    """FSDP's sharded parameters (DTensors) in a world of one process over gloo."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with Runtime(DistEnv(), device="cpu", threads=1) as r:
            yield r
    finally:
        dist.destroy_process_group()


def test_fsdp_shards_are_decided_on_the_device_reading_nothing_and_a_nan_leaves_them(fsdp_rt):
    from ddpkit.config import StrategyConfig
    from ddpkit.strategies.fsdp import FsdpStrategy

    strategy = FsdpStrategy(fsdp_rt, StrategyConfig(name="fsdp"))
    torch.manual_seed(0)
    model = strategy.setup_module(nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)))
    optimizer = strategy.setup_optimizer(lambda params: torch.optim.AdamW(params, lr=0.05), model)
    runner = StepRunner(
        fsdp_rt,
        strategy,
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        on_nan="skip",
        clip_grad_norm=0.5,
        device_decides=True,
    )
    counts, weights, skipped = [], [], []
    for i, (batch, n, g) in enumerate(_batches(6, nan_at=4), start=1):
        weights.append([p.full_tensor().clone() for p in model.parameters()])
        with HostReads(runner) as mode:
            skipped.append(runner.run(batch, n, g, f"epoch 1, step {i}").skipped)
        counts.append(len(mode.reads))
    assert runner._how == "snapshot" and counts[1:] == [0] * 5, counts
    assert _same(weights[4], weights[3]) and not _same(weights[5], weights[4])
    assert skipped == [0, 0, 0, 0, 1, 0] and runner.settle() == 0
