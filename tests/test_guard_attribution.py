"""Weights or data: the guard evaluates the current batch with every kept snapshot from before the anomaly.
A batch that is hard by itself is hard for older weights too; weights that degraded gradually leave the older
snapshots finding it easy. Losses here are closed-form: a 1x1 linear map on x = 1, so loss(w) = (w - y)^2."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_monitor as lm


class _Scalar(pl.LightningModule):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.lin.weight.fill_(w)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.lin(x), y)


class _Snap:
    """What the attribution reads of a snapshot: its step and its module state."""

    def __init__(self, step: int, w: float) -> None:
        self.step, self.w = step, w

    def state(self) -> dict:
        return {"module": {"lin.weight": torch.tensor([[self.w]])}}

    def mismatch(self, trainer) -> None:
        return None  # it fits the run


def _verdict(now_w: float, target: float, snaps: list[_Snap], level: float):
    guard = lm.DivergenceGuard()
    guard._snapshots = snaps
    guard._batch, guard._batch_idx = (torch.ones(8, 1), torch.full((8, 1), target)), 0
    module = _Scalar(now_w)
    weight = module.lin.weight.detach().clone()
    out = guard._attribute(SimpleNamespace(world_size=1), module, start=30, level=level, climb=True)
    assert torch.equal(module.lin.weight.detach(), weight)  # the present weights are put back
    return out


def test_gradual_degradation_is_the_weights_even_if_the_newest_snapshot_finds_the_batch_hard():
    # level 1 (= loss of w=1 on target 0); now w=3: loss 9. The newest snapshot (w=2.6, loss 6.76) sees
    # 5.76 of the rise of 8 (more than half: alone it would say "data"); the older one (w=1, loss 1) sees none.
    kind, now, before = _verdict(3.0, 0.0, [_Snap(10, 1.0), _Snap(20, 2.6)], level=1.0)
    assert kind == "weights" and now == pytest.approx(9.0) and before == pytest.approx(1.0)


def test_a_batch_hard_for_every_snapshot_is_the_data():
    # target -5: every weight near 1 finds the batch hard: (1 + 5)^2 = 36, (1.1 + 5)^2 = 37.21, now (1.2 + 5)^2
    kind, now, before = _verdict(1.2, -5.0, [_Snap(10, 1.0), _Snap(20, 1.1)], level=1.0)
    assert kind == "data" and now == pytest.approx(38.44) and before == pytest.approx(36.0)


def test_snapshots_from_after_the_anomaly_are_not_asked():
    # the only snapshot after start=30 would find the batch easy; the one before finds it hard: data
    kind, _, before = _verdict(1.2, -5.0, [_Snap(10, 1.1), _Snap(40, -5.0)], level=1.0)
    assert kind == "data" and before == pytest.approx(37.21)
    assert _verdict(1.2, -5.0, [_Snap(40, -5.0)], level=1.0) is None  # nothing from before: cannot tell
