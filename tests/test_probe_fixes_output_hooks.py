"""Forward hooks that replace a layer's output (a user hook that rescales it; quantization-aware training's
activation fake-quantization, which clamps it and zeroes the gradient outside the range): the probe reads the
gradient of the layer's own output, which is what its parameters' gradients are made of, whatever the hooks
registered before it do afterwards. It used to read the gradient of the replaced output (norms off up to 4x, and
``gns/g2`` off up to 50x in ``Trainer.fit`` with a coverage of 1). A QAT layer's fake-quantized weight (its
straight-through gradient is masked) is left out with the reason; its bias stays exact."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor, PerExampleGradNorms
from test_probe_fixes_oracle import NoiseScaleOracle, assert_exact, loop_oracle

HOOKS: dict[str, Callable[..., Tensor]] = {
    "rescale": lambda mod, inp, out: out * 2.0,
    "clamp": lambda mod, inp, out: out.clamp(-0.3, 0.3),  # as an activation fake-quantizer: gradient 0 outside
    # a hook that leaves the output and scales its gradient: the probe's own tensor hook must come after it (a probe
    # hook registered first read the gradient before the scaling: norms off 4x)
    "grad_hook": lambda mod, inp, out: (out.register_hook(lambda g: g * 0.5) if out.requires_grad else None) and None,
}


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def hooked_mlp(hook: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].register_forward_hook(HOOKS[hook])
    model[2].register_forward_hook(HOOKS[hook])
    return model


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("strategy", ["gram", "materialize", "auto"])
@pytest.mark.parametrize("shape", [(8, 10), (6, 3, 10)])
@pytest.mark.parametrize("hook", ["rescale", "clamp", "grad_hook"])
def test_hook_replacing_the_output_exact(hook: str, shape: tuple[int, ...], strategy: str, verify: bool) -> None:
    if hook == "grad_hook" and strategy == "auto" and len(shape) == 2:
        # the fused path computes inside the layer's patched forward, before any forward hook: a gradient scaled by
        # a tensor hook put on the output afterwards is not seen (a known limit, docs/gradient_noise_scale.md)
        pytest.xfail("a tensor hook on the output of a fused layer")
    model = hooked_mlp(hook)
    x = torch.randn(*shape) * 2
    y = torch.randint(0, 4, shape[:-1])
    with PerExampleGradNorms(model, linear_strategy=strategy, verify=verify) as probe:
        ce(model(x), y).backward()
    per = probe.per_parameter()
    assert probe.uncovered == []
    assert_exact(per, loop_oracle(model, ce, x, y))


def qat_model() -> nn.Module:
    import torch.ao.quantization as tq

    class QM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.dq = tq.QuantStub(), tq.DeQuantStub()
            self.fc, self.fc2, self.head = nn.Linear(10, 32), nn.Linear(32, 32), nn.Linear(32, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.dq(self.head(torch.relu(self.fc2(torch.relu(self.fc(self.q(x)))))))

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        model = QM().train()
        model.qconfig = tq.get_default_qat_qconfig("fbgemm")
        tq.prepare_qat(model, inplace=True)
        for _ in range(5):  # ranges observed on smaller inputs: the activations of larger ones are clamped
            model(torch.randn(8, 10) * 0.5)
        model.apply(tq.disable_observer)  # fixed ranges: the oracle sees the model the step saw
    return model


@pytest.mark.parametrize("verify", [True, False])
def test_qat_fake_quantized_activations_exact_and_weights_left_out(verify: bool) -> None:
    model = qat_model()
    x, y = torch.randn(8, 10) * 2, torch.randint(0, 4, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with PerExampleGradNorms(model, verify=verify) as probe:
            ce(model(x), y).backward()
        per = probe.per_parameter()
        ref = loop_oracle(model, ce, x, y)
    assert sorted(probe.uncovered) == ["fc.weight", "fc2.weight", "head.weight"]
    assert "fake-quantizes its weight" in probe.reasons["head.weight"]
    assert sorted(per) == ["fc.bias", "fc2.bias", "head.bias"]
    assert_exact(per, ref)


class _Wrap(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return ce(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("model", ["clamp", "qat"])
def test_fit_noise_scale_exact(model: str, tmp_path) -> None:
    net = qat_model() if model == "qat" else hooked_mlp("clamp")
    mon = GradientNoiseScaleMonitor(method="per_example", every_n_steps=1, smoothing=0.0, per_layer=False,
                                    linear_strategy="gram")
    oracle = NoiseScaleOracle(mon, ce, lambda m, xi: m.net(xi))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 10, generator=g) * torch.linspace(0.2, 3, 48)[:, None]
    y = torch.randint(0, 4, (48,), generator=g)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[oracle, mon],
                         default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Wrap(net), DataLoader(TensorDataset(x, y), batch_size=8))
    assert len(oracle.rows) == 4 and oracle.worst() < 1e-3
    coverage = float(trainer.callback_metrics["gns/coverage"])
    assert coverage == 1.0 if model == "clamp" else coverage < 0.9
