"""Models, data and LR schedules of the divergence zoo (``benchmarks/divergence_zoo.py``).

Every loader is indexed by step: batch ``i`` of the single epoch is the data of optimizer step ``i``
of an unguarded run, so two runs with the same seed see the same batches in the same order, and a
data recipe (a curriculum, a label shift, an injected bad batch) is keyed to a data position. The
loaders hold twice the steps of the run, so a guard that rolls back and skips batches does not run
out of data.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPTConfig, GPTModule, make_loader  # noqa: E402

GPT_CONFIG = {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32}

# ----------------------------------------------------------------------------- LR multipliers
# Callable dataclasses rather than lambdas: they pickle (spawn workers) and print readably.


@dataclass(frozen=True)
class Const:
    """Multiplier 1 throughout."""

    def __call__(self, step: int) -> float:
        return 1.0


@dataclass(frozen=True)
class Linear:
    """Linear from 1 to ``end`` over ``steps`` steps, then flat."""

    end: float
    steps: int

    def __call__(self, step: int) -> float:
        return 1.0 + (self.end - 1.0) * min(step, self.steps) / self.steps


@dataclass(frozen=True)
class Exp:
    """Exponential: x ``factor`` every ``every`` steps, from ``start`` on (1 before)."""

    factor: float
    every: int
    start: int = 0

    def __call__(self, step: int) -> float:
        return self.factor ** (max(0, step - self.start) / self.every)


@dataclass(frozen=True)
class Jump:
    """1 before ``at``, ``factor`` from ``at`` on (a sudden jump up, or a step decay when < 1)."""

    at: int
    factor: float

    def __call__(self, step: int) -> float:
        return self.factor if step >= self.at else 1.0


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up over ``warmup`` steps, then cosine to ``floor`` at ``steps``."""

    warmup: int
    steps: int
    floor: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * t))


@dataclass(frozen=True)
class SGDR:
    """Cosine with warm restarts: periods ``period``, ``period * mult``, ... (Loshchilov and Hutter)."""

    period: int
    mult: int = 2
    floor: float = 0.01

    def __call__(self, step: int) -> float:
        period, s = self.period, step
        while s >= period:
            s, period = s - period, period * self.mult
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * s / period))


@dataclass(frozen=True)
class Capped:
    """``fn`` frozen at its value of step ``at``: a matched control, identical to ``fn`` up to ``at``."""

    fn: Callable[[int], float]
    at: int

    def __call__(self, step: int) -> float:
        return self.fn(min(step, self.at))


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Data:
    """Data recipe.

    Attributes:
        source: ``"prose"`` (the language models; ``"arith"`` first when ``curriculum`` is set), ``"digits"``
            or ``"friedman"`` (regression: sklearn's ``make_friedman1``, 10 features, standardised target).
        batch: batch size.
        label_noise: fraction of digit labels replaced by another class, fixed for the run.
        random_labels_at: from this step on, digit labels are uniformly random (a data shift).
        curriculum: up to this step, easy data (GPT: the arithmetic corpus; digits: classes 0-4 only).
        target_noise: regression only, the noise of the target (in units of the clean target's spread).
    """

    source: str
    batch: int = 16
    label_noise: float = 0.0
    random_labels_at: Optional[int] = None
    curriculum: Optional[int] = None
    target_noise: float = 0.1


@lru_cache(maxsize=1)
def _digits() -> tuple[Tensor, Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1.0)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def _digits_loader(data: Data, n_batches: int, seed: int) -> DataLoader:
    x, y = _digits()
    rng = np.random.default_rng(seed)
    y = y.clone()
    if data.label_noise:
        flip = rng.random(len(y)) < data.label_noise
        y[flip] = (y[flip] + torch.from_numpy(rng.integers(1, 10, int(flip.sum())))) % 10
    n = n_batches * data.batch
    easy = np.flatnonzero(y.numpy() < 5)
    n_easy = 0 if data.curriculum is None else min(n, data.curriculum * data.batch)
    order = [easy[rng.permutation(len(easy))] for _ in range(n_easy // len(easy) + 1)]
    index = np.concatenate(order)[:n_easy] if n_easy else np.empty(0, dtype=np.int64)
    rest = n - n_easy
    index = np.concatenate([index] + [rng.permutation(len(y)) for _ in range(rest // len(y) + 1)])[:n]
    labels = y[index]
    if data.random_labels_at is not None:
        start = data.random_labels_at * data.batch
        labels[start:] = torch.from_numpy(rng.integers(0, 10, n - start))
    return DataLoader(TensorDataset(x[index], labels), batch_size=data.batch, shuffle=False)


def _text_loader(data: Data, n_batches: int, seed: int) -> DataLoader:
    block = GPT_CONFIG["block_size"]
    n_easy = 0 if data.curriculum is None else data.curriculum * data.batch
    n = n_batches * data.batch
    parts = []
    if n_easy:
        parts.append(make_loader("arith", block, data.batch, n_easy, seed=seed, shuffle=False, n_chars=50_000).dataset)
    parts.append(make_loader("prose", block, data.batch, n - n_easy, seed=seed, shuffle=False, n_chars=100_000).dataset)
    return DataLoader(ConcatDataset(parts), batch_size=data.batch, shuffle=False)


def _friedman_loader(data: Data, n_batches: int, seed: int) -> DataLoader:
    from sklearn.datasets import make_friedman1

    x, y = make_friedman1(n_samples=2000, n_features=10, noise=0.0, random_state=1000 + seed)
    y = (y - y.mean()) / y.std()
    rng = np.random.default_rng(seed)
    y = y + data.target_noise * rng.standard_normal(len(y))
    x = (x - x.mean(0)) / x.std(0)
    n = n_batches * data.batch
    index = np.concatenate([rng.permutation(len(y)) for _ in range(n // len(y) + 1)])[:n]
    return DataLoader(TensorDataset(torch.tensor(x[index], dtype=torch.float32),
                                    torch.tensor(y[index], dtype=torch.float32)), batch_size=data.batch, shuffle=False)


def make_data(data: Data, steps: int, seed: int) -> DataLoader:
    """The step-indexed loader of ``data`` (2 x ``steps`` batches, in a fixed order)."""
    make = {"digits": _digits_loader, "friedman": _friedman_loader}.get(data.source, _text_loader)
    return make(data, 2 * steps, seed)


# ----------------------------------------------------------------------------- models


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ZooMixin:
    """Optimizer (SGD with momentum 0.9, or AdamW), per-step LR multiplier and batch injections.

    ``injection = (batch_index, kind)`` corrupts the batch at that data position (not the optimizer step,
    so a guard that rolls back past it does not meet it again): ``"nan_loss"`` (the loss becomes NaN),
    ``"nan_input"``, ``"inf_input"`` or ``"huge_input"`` (noise of scale 1e3 instead of the inputs: a corrupted
    batch; scaling the inputs instead only makes a trained ReLU-like net more confident). Float inputs only.
    """

    optimizer_name: str
    lr: float
    lr_mult: Callable[[int], float]
    injection: Optional[tuple[int, str]]

    def _set_zoo(self, optimizer: str, lr: float, lr_mult: Callable[[int], float],
                 injection: Optional[tuple[int, str]]) -> None:
        self.optimizer_name, self.lr, self.lr_mult, self.injection = optimizer, lr, lr_mult, injection

    def _injected(self, batch_idx: int, kind: str) -> bool:
        return self.injection is not None and self.injection == (batch_idx, kind)

    def _corrupt_input(self, x: Tensor, batch_idx: int) -> Tensor:
        if self._injected(batch_idx, "nan_input"):
            return torch.full_like(x, math.nan)
        if self._injected(batch_idx, "inf_input"):
            return torch.full_like(x, math.inf)
        if self._injected(batch_idx, "huge_input"):
            return 1e3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(batch_idx)).to(x)
        return x

    def _corrupt_loss(self, loss: Tensor, batch_idx: int) -> Tensor:
        return loss * math.nan if self._injected(batch_idx, "nan_loss") else loss

    def configure_optimizers(self) -> Any:
        params = self.parameters()  # type: ignore[attr-defined]
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        elif self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.01)
        else:
            raise ValueError(f"unknown optimizer {self.optimizer_name!r}")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_mult)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ZooGPT(ZooMixin, GPTModule):
    """The example GPT with the zoo's optimizers, LR multiplier and injections."""

    def __init__(self, layernorm: bool, optimizer: str, lr: float, lr_mult: Callable[[int], float],
                 injection: Optional[tuple[int, str]] = None) -> None:
        super().__init__(GPTConfig(**GPT_CONFIG, layernorm=layernorm), lr=lr)
        self._set_zoo(optimizer, lr, lr_mult, injection)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        return self._corrupt_loss(_lm_loss(logits, y), batch_idx)


class DigitsClassifier(ZooMixin, pl.LightningModule):
    """An MLP (``arch="mlp"``: 64-128-128-10, GELU) or a small CNN with BatchNorm (``arch="cnn"``) on 8x8 digits."""

    def __init__(self, arch: str, optimizer: str, lr: float, lr_mult: Callable[[int], float],
                 injection: Optional[tuple[int, str]] = None) -> None:
        super().__init__()
        self._set_zoo(optimizer, lr, lr_mult, injection)
        if arch == "mlp":
            self.net: nn.Module = nn.Sequential(
                nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
        elif arch == "cnn":
            self.net = nn.Sequential(
                nn.Unflatten(1, (1, 8, 8)),
                nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
        else:
            raise ValueError(f"unknown arch {arch!r}")

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(self._corrupt_input(x, batch_idx)), y)
        return self._corrupt_loss(loss, batch_idx)


class ZooHFGPT2(ZooMixin, pl.LightningModule):
    """Hugging Face's ``GPT2LMHeadModel`` from a tiny random-init config (2 layers, 32 wide, no dropout) on
    the prose characters."""

    def __init__(self, optimizer: str, lr: float, lr_mult: Callable[[int], float],
                 injection: Optional[tuple[int, str]] = None) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        from gpt import VOCAB

        self._set_zoo(optimizer, lr, lr_mult, injection)
        cfg = GPT2Config(vocab_size=len(VOCAB), n_positions=GPT_CONFIG["block_size"], n_embd=GPT_CONFIG["d_model"],
                         n_layer=GPT_CONFIG["n_layer"], n_head=GPT_CONFIG["n_head"], resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(cfg)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return self._corrupt_loss(_lm_loss(logits, y), batch_idx)


class ZooLSTM(ZooMixin, pl.LightningModule):
    """A character LSTM language model (embedding 32, one LSTM layer of 64, linear head) on the prose."""

    def __init__(self, optimizer: str, lr: float, lr_mult: Callable[[int], float],
                 injection: Optional[tuple[int, str]] = None) -> None:
        super().__init__()
        from gpt import VOCAB

        self._set_zoo(optimizer, lr, lr_mult, injection)
        self.emb = nn.Embedding(len(VOCAB), 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, len(VOCAB))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.head(self.lstm(self.emb(x))[0])
        return self._corrupt_loss(_lm_loss(logits, y), batch_idx)


class ZooRegressor(ZooMixin, pl.LightningModule):
    """An MLP regressor (10-64-64-1, tanh) with a mean squared error loss on Friedman's function."""

    def __init__(self, optimizer: str, lr: float, lr_mult: Callable[[int], float],
                 injection: Optional[tuple[int, str]] = None) -> None:
        super().__init__()
        self._set_zoo(optimizer, lr, lr_mult, injection)
        self.net = nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(self._corrupt_input(x, batch_idx)).squeeze(-1), y)
        return self._corrupt_loss(loss, batch_idx)
