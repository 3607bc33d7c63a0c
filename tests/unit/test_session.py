"""The own-loop Session on one process: what rt.wrap / rt.save / rt.load refuse, and files that
load without ddpkit (issue 15). Multi-process parity: tests/distributed/test_own_loop.py."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import DdpkitError
from ddpkit.data import global_order
from ddpkit.environments import DistEnv
from ddpkit.ownloop.session import Session
from ddpkit.runtime import Runtime


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture
def rt():
    with Session(DistEnv(), device="cpu", threads=1) as s:
        yield s


def test_fsdp_on_one_process_and_unknown_strategies_are_refused(rt):
    with pytest.raises(DdpkitError, match="needs at least 2"):
        rt.wrap(_model(), strategy="fsdp")
    with pytest.raises(DdpkitError, match="'ddp' or 'fsdp'"):
        rt.wrap(_model(), strategy="deepspeed")


def test_ddp_options_with_fsdp_and_fp16_on_cpu_are_refused(rt):
    with pytest.raises(DdpkitError, match="DDP options"):
        rt.wrap(_model(), strategy="fsdp", find_unused_parameters=True)
    with pytest.raises(DdpkitError, match="fp16 needs a CUDA GPU"):
        rt.wrap(_model(), precision="fp16")


def test_bf16_on_a_cpu_without_native_bfloat16_is_refused(rt, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)  # what ddpkit asks torch
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.raises(DdpkitError, match="this CPU has no native bfloat16"):
        rt.wrap(_model(), precision="bf16")
    model = _model()
    assert rt.wrap(model) is model  # the refusal left nothing behind: fp32 is still open to this session


def test_wrap_returns_model_and_optimizer_and_refuses_a_foreign_optimizer(rt):
    m = _model()
    model, opt = rt.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    assert isinstance(opt, torch.optim.SGD) and model is m  # one process: no DDP
    second = _model()
    assert rt.wrap(second) is second  # a second model alike (a GAN's two): no optimizer given, the model alone
    with pytest.raises(DdpkitError, match="already wraps with strategy='ddp', precision='fp32'"):
        rt.wrap(_model(), precision="bf16")
    with pytest.raises(DdpkitError, match="not this model's"):
        rt.save("x.pt", model, torch.optim.SGD(_model().parameters(), lr=0.1))


def test_whole_save_loads_without_ddpkit_and_back_with_rt_load(rt, tmp_path):
    model = rt.wrap(_model())
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    rt.save(str(tmp_path / "s.pt"), model, opt, step=7)
    plain = _model()
    plain.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True)["model"])
    other = _model()
    other_opt = torch.optim.Adam(other.parameters())
    assert rt.load(str(tmp_path / "s.pt"), other, other_opt) == {"step": 7}
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters(), strict=True))
    assert other_opt.state_dict()["state"][0]["step"] == 1


def test_sharded_save_on_one_process_round_trips(rt, tmp_path):
    model = _model()
    rt.save(str(tmp_path / "d"), model, sharded=True, note="x")
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert rt.load(str(tmp_path / "d"), other) == {"note": "x"}
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters(), strict=True))
    assert not list(tmp_path.glob(".*partial"))


def test_meta_weights_nan_weights_and_foreign_files_are_refused(rt, tmp_path):
    with torch.device("meta"):
        meta = _model()
    with pytest.raises(DdpkitError, match="meta device"):
        rt.save(str(tmp_path / "m.pt"), meta)
    bad = _model()
    with torch.no_grad():
        bad[0].weight[0, 0] = float("nan")
    with pytest.raises(DdpkitError, match="NaN"):
        rt.save(str(tmp_path / "n.pt"), bad)
    assert not (tmp_path / "n.pt").exists()
    torch.save(_model().state_dict(), tmp_path / "plain.pt")
    with pytest.raises(DdpkitError, match="not a file written by ddpkit"):
        rt.load(str(tmp_path / "plain.pt"), _model())


def test_the_session_holds_a_runtime_and_lends_the_trainings_clipping_and_loader(rt):
    assert isinstance(rt.runtime, Runtime) and not isinstance(rt, Runtime)
    assert (rt.rank, rt.world_size, rt.is_main, rt.device.type, rt.distributed) == (0, 1, True, "cpu", False)
    model = rt.wrap(_model())
    model(torch.randn(8, 4)).pow(2).sum().backward()
    norm = lambda: torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()  # noqa: E731
    before = norm()
    assert rt.clip_grad_norm(model, 0.1) == pytest.approx(before, rel=1e-6) and before > 0.1
    assert norm() == pytest.approx(0.1, rel=1e-5)
    loader = rt.loader(TensorDataset(torch.arange(10.0)), batch_size=4, seed=3)
    loader.set_epoch(2)
    assert (
        torch.cat([b[0] for b in loader]).tolist() == global_order(10, 2, 3).float().tolist()
    )  # the run's global order
