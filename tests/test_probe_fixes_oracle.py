"""The independent oracle of the ``test_probe_fixes_*`` tests: each example's gradient by its own
``torch.autograd.grad`` call (a loop over examples), and a callback that checks the noise scale
``GradientNoiseScaleMonitor`` logs in ``Trainer.fit`` against it. Checked here against torch.func."""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

Forward = Callable[[nn.Module, Tensor], Tensor]


def loop_grads(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor,
               forward: Optional[Forward] = None, bdim: int = 0) -> dict[str, Tensor]:
    """``{name: Tensor[B, *param.shape]}`` (float64): each example's gradient of its own loss, one
    ``torch.autograd.grad`` per example (``x`` holds the batch along ``bdim``, ``y`` along 0); 0 where unused."""
    forward = forward or (lambda m, xi: m(xi))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: torch.zeros(x.shape[bdim], *p.shape, dtype=torch.float64) for n, p in params.items()}
    for i in range(x.shape[bdim]):
        loss = loss_fn(forward(model, x.narrow(bdim, i, 1)), y[i:i + 1])
        for n, g in zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)):
            if g is not None:
                out[n][i] = g.double()
    return out


def loop_oracle(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor,
                forward: Optional[Forward] = None, bdim: int = 0) -> dict[str, Tensor]:
    """``{name: Tensor[B]}``: each example's squared gradient norm (see :func:`loop_grads`)."""
    return {n: g.reshape(g.shape[0], -1).pow(2).sum(1) for n, g in loop_grads(model, loss_fn, x, y, forward, bdim).items()}


def assert_exact(per: dict[str, Tensor], ref: dict[str, Tensor], tol: float = 1e-4) -> None:
    """Every parameter in ``per`` within ``tol`` (relative, per example) of the oracle ``ref``."""
    assert per, "nothing covered"
    for name, v in per.items():
        assert v.shape == ref[name].shape, (name, v.shape, ref[name].shape)
        err = (v.double() - ref[name]).abs() / ref[name].clamp_min(1e-12)
        assert float(err.max()) <= tol, (name, v, ref[name])


def noise_scale_truth(grads: dict[str, Tensor], names: list[str]) -> tuple[float, float]:
    """``(|G|^2, tr(Sigma))`` of McCandlish et al.'s unbiased estimators with ``B_small = 1``, ``B_big = B`` from
    the per-example gradients ``grads`` of the parameters ``names``."""
    b = next(iter(grads.values())).shape[0]
    small = sum(float(grads[n].reshape(grads[n].shape[0], -1).pow(2).sum(1).mean()) for n in names)
    big = sum(float(grads[n].mean(0).pow(2).sum()) for n in names)
    return (b * big - small) / (b - 1), (small - big) / (1 - 1 / b)


class NoiseScaleOracle(pl.Callback):
    """Put it before the monitor (``smoothing=0``): at every batch start, the per-example gradients of the batch by
    :func:`loop_grads` on the model as the step's forward will see it; at the batch end, the ``gns/g2`` and
    ``gns/trace_sigma`` logged against the estimators over the parameters the monitor measured."""

    def __init__(self, monitor: Any, loss_fn: Callable[[Tensor, Tensor], Tensor], forward: Forward) -> None:
        self.monitor, self.loss_fn, self.forward = monitor, loss_fn, forward
        self.rows: list[tuple[int, float, float, float, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.grads = loop_grads(pl_module, self.loss_fn, batch[0], batch[1], self.forward)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           i: int) -> None:
        m = trainer.callback_metrics
        if "gns/g2" not in m:
            return
        g2, tr = noise_scale_truth(self.grads, sorted(self.monitor._measured))
        self.rows.append((trainer.global_step, g2, float(m["gns/g2"]), tr, float(m["gns/trace_sigma"])))

    def worst(self) -> float:
        assert self.rows, "no check was logged"
        return max(max(abs(a - b) / max(abs(a), 1e-9), abs(c - d) / max(abs(c), 1e-9)) for _, a, b, c, d in self.rows)


def test_loop_oracle_agrees_with_torch_func() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    ref = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    ours = loop_grads(model, F.cross_entropy, x, y)
    for n in params:
        torch.testing.assert_close(ours[n].float(), ref[n], rtol=1e-5, atol=1e-7)
