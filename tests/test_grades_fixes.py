"""GradientEarlyStopping in real Trainer.fit runs: an output head beside blocks whose MLP is an nn.Sequential, a step
whose loss is not finite or whose gradients were zeroed before GradES read them, LBFGS, and the ``released`` alert."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard, GradientEarlyStopping
from lightning_monitor.functional import find_components

V, D, T = 12, 8, 5


def _trainer(callbacks: list, max_steps: int, tmp_path: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, callbacks=callbacks,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=tmp_path)


def _tokens(n: int, shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (n, T), generator=g)
    y = torch.where(torch.rand(n, T, generator=g) < 0.3, torch.randint(0, V, (n, T), generator=g), (x + 1) % V)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=shuffle, generator=torch.Generator().manual_seed(0))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.q_proj, self.up_proj, self.down_proj = nn.Linear(D, D), nn.Linear(D, 16), nn.Linear(16, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.q_proj(self.ln(x)))
        return x + self.down_proj(torch.tanh(self.up_proj(h)))


class _TokenLM(pl.LightningModule):
    """Embedding, two blocks of three components, a Linear head."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(D, V)
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.5, history_size=5, max_iter=3,
                                     line_search_fn=getattr(self, "line_search", None))
        return torch.optim.AdamW(self.parameters(), lr=0.01)


# --------------------------------------------------------------------------- the output head


class _ViTBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))  # the usual FeedForward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class _ViT(pl.LightningModule):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Linear(12, d)
        self.blocks = nn.ModuleList(_ViTBlock(d) for _ in range(2))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(0.0), nn.Linear(d, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_head_beside_blocks_with_a_sequential_mlp_is_no_component(tmp_path: Any) -> None:
    """A block's ``mlp = Sequential(Linear, GELU, Linear)`` is part of the blocks, not a twin of the classifier head
    ``Sequential(Linear, Tanh, Dropout, Linear)``: the head is no component and keeps training while every component
    freezes (tau=10: all freeze at the first check after the reference). Before, its two Linears were components
    and froze."""
    model = _ViT()
    found = sorted(find_components(model))
    assert not [n for n in found if n.startswith("head")]
    assert "blocks.0.mlp.0" in found and "blocks.1.mlp.2" in found and "blocks.0.attn" in found
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, 12, generator=g), torch.randint(0, 3, (64,), generator=g)),
                      batch_size=16)
    grades = GradientEarlyStopping(tau=10.0, grace_steps=2, every_n_steps=1, min_loss_progress=None, stop=False)
    head_before = [p.detach().clone() for p in model.head.parameters()]
    _trainer([grades], 6, tmp_path).fit(model, data)
    assert grades.frozen and not [n for n in grades.components if n.startswith("head")]
    assert all(p.requires_grad for p in model.head.parameters())
    assert not all(torch.equal(p.detach(), b) for p, b in zip(model.head.parameters(), head_before))  # it trained


# --------------------------------------------------------------------------- steps that tell nothing


BAD = 40


class _NaNOnce(_TokenLM):
    """One batch with a NaN loss, at step ``BAD``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == BAD and not getattr(self, "_done", False):
            self._done = True
            loss = loss * float("nan")
        return loss


class _ZeroGradsAt(pl.Callback):
    """Zeroes every gradient of step ``step`` in ``on_before_optimizer_step``, as DivergenceGuard does to a
    non-finite step, here with a finite loss."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == self.step:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.zero_()


def test_nan_batch_with_the_guard_listed_first_freezes_nothing(tmp_path: Any) -> None:
    """DivergenceGuard listed before GradES zeroes the gradients of the NaN step before GradES reads them: read, they
    gave every component a ratio of 0 and froze all six (a rollback does not undo freezes), and the run stopped at
    step 40 of 60 (the paper's raw rule). The step is left out: nothing freezes, the run trains its 60 steps, and
    the smoothed statistics stay finite."""
    grades = GradientEarlyStopping(every_n_steps=2, grace_steps=20, smoothing=0.0, min_loss_progress=None)
    trainer = _trainer([DivergenceGuard(), grades], 60, tmp_path)
    trainer.fit(_NaNOnce(), _tokens(256))
    assert grades.frozen == {} and grades.stopped_at is None
    assert trainer.global_step == 60
    assert torch.isfinite(grades._smoothed).all()


def test_zeroed_gradients_with_a_finite_loss_freeze_nothing(tmp_path: Any) -> None:
    """Every gradient of a step zeroed before GradES reads them (a callback listed first), the loss finite: the
    check is left out. Read, the zeros froze every component at that step (the raw rule) and stopped the run."""
    grades = GradientEarlyStopping(every_n_steps=2, grace_steps=20, smoothing=0.0, min_loss_progress=None)
    trainer = _trainer([_ZeroGradsAt(BAD), grades], 60, tmp_path)
    trainer.fit(_TokenLM(), _tokens(256))
    assert BAD not in grades.frozen.values() and grades.stopped_at != BAD
    assert trainer.global_step == 60


def test_zeroed_step_leaves_the_ema_as_it_was(tmp_path: Any) -> None:
    """With the default smoothing, the zeroed check does not enter the EMA: the smoothed statistics after it are those
    of the check before (read, they were all multiplied by 0.9)."""
    grades = GradientEarlyStopping(every_n_steps=2, grace_steps=1000, min_loss_progress=None)
    seen: dict[int, torch.Tensor] = {}

    class Smoothed(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            seen[trainer.global_step] = grades._smoothed.detach().clone()

    _trainer([_ZeroGradsAt(10), grades, Smoothed()], 12, tmp_path).fit(_TokenLM(), _tokens(256))
    # step 10's check ran and ended at global_step 11; the check before, step 8, at 9
    assert torch.equal(seen[11], seen[9])
    assert not torch.equal(seen[9], seen[7])


# --------------------------------------------------------------------------- LBFGS


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_lbfgs_frozen_components_stay_unchanged(tmp_path: Any, line_search: Optional[str]) -> None:
    """LBFGS moves every parameter along a direction from its history, frozen ones included (they moved by up to 0.018
    in seven steps). The freeze restarts that history: a frozen component's weights at the end are bitwise those at
    the start of its freeze step, and the rest of the model still trains."""
    model = _TokenLM("lbfgs")
    model.line_search = line_search
    grades = GradientEarlyStopping(tau=5.0, grace_steps=2, every_n_steps=1, min_loss_progress=None, stop=False,
                                   include=["blocks.0.*_proj"])
    at_start: dict[int, dict[str, torch.Tensor]] = {}

    class Weights(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            at_start[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    _trainer([grades, Weights()], 10, tmp_path).fit(model, _tokens(64, shuffle=False))
    assert sorted(grades.frozen) == ["blocks.0.down_proj", "blocks.0.q_proj", "blocks.0.up_proj"]
    final = dict(model.named_parameters())
    for name, step in grades.frozen.items():
        assert step < 9
        for suffix in ("weight", "bias"):
            key = f"{name}.{suffix}"
            assert torch.equal(final[key].detach(), at_start[step][key]), key
    first = min(grades.frozen.values())
    assert not torch.equal(final["blocks.1.q_proj.weight"].detach(), at_start[first]["blocks.1.q_proj.weight"])


# --------------------------------------------------------------------------- the released alert


class _UnfreezeAllAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            pl_module.requires_grad_(True)


def test_released_alert_names_the_components(tmp_path: Any) -> None:
    """The ``released`` alert lists the components released in ``details["components"]``, so that a report can take
    them out of the frozen ones."""
    grades = GradientEarlyStopping(tau=1e6, grace_steps=4, every_n_steps=2, stop=False, min_loss_progress=None)
    _trainer([_UnfreezeAllAt(9), grades], 12, tmp_path).fit(_TokenLM(), _tokens(256))
    said = [a for a in grades.hub.history if a.kind == "released"]
    assert len(said) == 1
    assert said[0].details == {"components": list(grades.released)}
    assert sorted(said[0].details["components"]) == sorted(grades.components)
