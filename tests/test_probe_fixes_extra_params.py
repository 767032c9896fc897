"""Layers holding parameters of their own besides the ones their handler computes (loralib-style ``lora.Linear``
with ``lora_A`` / ``lora_B``, the old ``torch.nn.utils.weight_norm`` with ``weight_g`` / ``weight_v``): those
parameters are listed as uncovered with the reason, the rest of the layer stays covered and exact (against a loop
over examples with ``torch.autograd.grad``), and ``Trainer.fit`` runs on. They used to crash the backward pass
with a ``KeyError``."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor, PerExampleGradNorms
from lightning_monitor.probes.per_example import HANDLERS, Handler, project_matrix, register
from test_probe_fixes_oracle import NoiseScaleOracle, assert_exact, loop_oracle


class LoRALinear(nn.Linear):
    """As ``loralib.Linear``: the base weight frozen, the adapters parameters of the Linear itself."""

    def __init__(self, d_in: int, d_out: int, r: int = 2) -> None:
        super().__init__(d_in, d_out)
        self.lora_A = nn.Parameter(torch.randn(r, d_in) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(d_out, r) * 0.1)
        self.weight.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + (x @ self.lora_A.T) @ self.lora_B.T


def weight_norm(module: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old API is deprecated, and still used
        return torch.nn.utils.weight_norm(module)


def models() -> dict[str, tuple[nn.Module, list[str]]]:
    torch.manual_seed(0)
    return {
        "lora": (nn.Sequential(LoRALinear(10, 16), nn.Tanh(), nn.Linear(16, 4)), ["0.lora_A", "0.lora_B"]),
        "weight_norm_linear": (nn.Sequential(weight_norm(nn.Linear(10, 16)), nn.Tanh(), nn.Linear(16, 4)),
                               ["0.weight_g", "0.weight_v"]),
        "weight_norm_conv1d": (nn.Sequential(nn.Unflatten(1, (1, 10)), weight_norm(nn.Conv1d(1, 4, 3)), nn.Tanh(),
                                             nn.Flatten(), nn.Linear(32, 4)), ["1.weight_g", "1.weight_v"]),
    }


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("kind", ["lora", "weight_norm_linear", "weight_norm_conv1d"])
def test_parameters_the_handler_does_not_compute_are_uncovered_and_the_rest_exact(kind: str, verify: bool) -> None:
    model, extra = models()[kind]
    x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
    probe = PerExampleGradNorms(model, verify=verify)
    assert sorted(probe.uncovered) == extra  # known when the probe is built, before any backward
    for name in extra:
        assert "not computed by the handler" in probe.reasons[name]
    with probe:
        F.cross_entropy(model(x), y).backward()
    per = probe.per_parameter()
    assert sorted(probe.uncovered) == extra
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(per) == trainable - set(extra)  # the layer's bias and the other layers stay covered
    assert_exact(per, loop_oracle(model, F.cross_entropy, x, y))


class _Wrap(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("kind", ["lora", "weight_norm_linear", "weight_norm_conv1d"])
def test_fit_runs_on_and_names_the_parameters_left_out(kind: str, tmp_path) -> None:
    model, extra = models()[kind]
    mon = GradientNoiseScaleMonitor(method="per_example", every_n_steps=1, per_layer=False, smoothing=0.0)
    oracle = NoiseScaleOracle(mon, F.cross_entropy, lambda m, xi: m.net(xi))
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[oracle, mon],
                         default_root_dir=str(tmp_path))
    x, y = torch.randn(64, 10), torch.randint(0, 4, (64,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Wrap(model), DataLoader(TensorDataset(x, y), batch_size=8))
    assert trainer.global_step == 3 and mon.ema.count == 3
    assert sorted(mon._probe.uncovered) == ["net." + n for n in extra]
    assert 0.0 < float(trainer.callback_metrics["gns/coverage"]) < 1.0
    assert len(oracle.rows) == 3 and oracle.worst() < 1e-3  # the estimate of the parameters covered, exact


class Scaled(nn.Module):
    """``weight * x * scale``: a type whose handler (registered below) knows ``weight`` only and does not say so."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight * self.scale


class _WeightOnly(Handler):
    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        return {"weight": (g.float() * x.float() * m.scale.detach()).reshape(x.shape[0], -1, x.shape[-1]).sum(1)}

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: object) -> dict[str, Tensor]:
        return {"weight": self.grads(m, x, g)["weight"].pow(2).sum(1)}

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        return {"weight": project_matrix(self.grads(m, x, g)["weight"].sum(0), *uv["weight"])}


@pytest.mark.parametrize("verify", [True, False])
def test_a_handler_returning_fewer_parameters_than_its_module_holds_leaves_them_out(verify: bool) -> None:
    register(Scaled)(_WeightOnly)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), Scaled(6), nn.Tanh(), nn.Linear(6, 3))
        x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
        with PerExampleGradNorms(model, verify=verify) as probe:
            F.cross_entropy(model(x), y).backward()
        per = probe.per_parameter()
        assert probe.uncovered == ["1.scale"]
        assert "returned no per-example norm" in probe.reasons["1.scale"]
        assert set(per) == {n for n, _ in model.named_parameters()} - {"1.scale"}
        assert_exact(per, loop_oracle(model, F.cross_entropy, x, y))
    finally:
        HANDLERS.pop(Scaled, None)
