"""SpectralAlignmentMonitor on torch's ``nn.MultiheadAttention`` (``nn.TransformerEncoder``): its packed input
projection (rows: the query) and its ``out_proj`` (rows: the attention's output, seen by routing the attention's
calls through ``out_proj`` on due steps), against an oracle that recomputes the attention by hand and takes the full
SVD; nothing installed on other steps; the outputs of a due step unchanged."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import SpectralAlignmentMonitor
from lightning_monitor.probes.per_example.attention import route_out_proj

D, HEADS, T = 16, 4, 6


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, HEADS, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, 3), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def attention_output(mha: nn.MultiheadAttention, x: Tensor) -> Tensor:
    """The input of ``out_proj`` for self-attention on batch-first ``x``, written out (no mask, no dropout)."""
    n, t, e = x.shape
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    split = lambda z: z.reshape(n, t, HEADS, e // HEADS).transpose(1, 2)  # noqa: E731
    w = torch.softmax(split(q) @ split(k).transpose(-1, -2) / math.sqrt(e // HEADS), dim=-1)
    return (w @ split(v)).transpose(1, 2).reshape(n * t, e)


class Oracle(pl.Callback):
    """On due steps: the rows each attention layer saw (recomputed by hand from its input) and the full SVD of its
    matrices, before the update; the monitor's own v_1 applied to all rows."""

    def __init__(self, monitor: SpectralAlignmentMonitor) -> None:
        self.monitor, self.inputs, self.expected = monitor, {}, {}
        self.handles: list[Any] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.monitor.is_due(trainer.global_step):
            return
        for i, layer in enumerate(pl_module.enc.layers):
            self.handles.append(layer.self_attn.register_forward_pre_hook(
                lambda m, a, i=i: self.inputs.__setitem__(i, a[0].detach().clone())))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        step = trainer.global_step
        if not self.monitor.is_due(step):
            return
        for i, layer in enumerate(pl_module.enc.layers):
            mha, x = layer.self_attn, self.inputs[i]
            with torch.no_grad():
                rows = {f"enc.layers.{i}.self_attn": x.reshape(-1, D),
                        f"enc.layers.{i}.self_attn.out_proj": attention_output(mha, x)}
            mats = {f"enc.layers.{i}.self_attn": mha.in_proj_weight, f"enc.layers.{i}.self_attn.out_proj": mha.out_proj.weight}
            for name, r in rows.items():
                s = np.linalg.svd(mats[name].detach().double().numpy(), compute_uv=False)
                v = self.monitor._vectors[name][:, 0].double().numpy()
                r64 = r.double().numpy()
                a = (r64 @ v) / np.linalg.norm(r64, axis=1)
                p = float(np.mean(a > 0))
                self.expected[(step, name)] = {"sigma": s[0], "sign_diversity": 2 * min(p, 1 - p),
                                               "mean_abs": float(np.mean(np.abs(a)))}


class Logged(pl.Callback):
    def __init__(self) -> None:
        self.values: dict[tuple[int, str], float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        for k, v in trainer.callback_metrics.items():
            if k.startswith("sa/") and "self_attn" in k:
                self.values[(trainer.global_step - 1, k)] = float(v)


def _fit(callbacks: list[Any], steps: int, tmp_path: Any) -> pl.Trainer:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, T, D, generator=g), torch.randint(0, 3, (64, T), generator=g)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=str(tmp_path))
    trainer.fit(Encoder(), DataLoader(TensorDataset(x, y), batch_size=8))
    return trainer


def test_attention_layers_match_the_oracle(tmp_path) -> None:
    pl.seed_everything(0)
    mon = SpectralAlignmentMonitor(every_n_steps=3, max_rows=10_000, n_iter=60)
    oracle, logged = Oracle(mon), Logged()
    _fit([mon, oracle, logged], 7, tmp_path)
    attn = {f"enc.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn", "self_attn.out_proj")}
    assert attn <= set(mon.layers)
    assert mon._hub is not None and not [a for a in mon._hub.history if a.kind == "layers_not_called"]
    checked = 0
    for (step, name), ref in oracle.expected.items():
        for stat in ("sign_diversity", "mean_abs"):
            assert logged.values[(step, f"sa/{name}/{stat}")] == pytest.approx(ref[stat], abs=1e-5), (step, name, stat)
        assert logged.values[(step, f"sa/{name}/sigma")] == pytest.approx(ref["sigma"], rel=1e-3), (step, name)
        checked += 1
    assert checked == 3 * len(attn)  # steps 0, 3, 6


def test_routing_leaves_the_outputs_bit_for_bit_and_is_removed() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, HEADS, batch_first=True)
    x = torch.randn(4, T, D)
    plain = mha(x, x, x)
    seen: list[Tensor] = []
    hook = mha.out_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    handles = route_out_proj(mha)
    routed = mha(x, x, x)
    for h in handles:
        h.remove()
    after = mha(x, x, x)
    hook.remove()
    assert torch.equal(plain[0], routed[0]) and torch.equal(plain[1], routed[1])
    assert len(seen) == 1 and seen[0].shape == (4 * T, D)  # seen once while routed, not after
    assert torch.equal(after[0], plain[0]) and F.linear is torch._C._nn.linear


def test_nothing_installed_on_steps_not_due(tmp_path) -> None:
    mon = SpectralAlignmentMonitor(every_n_steps=100)
    counts: list[int] = []

    class Count(pl.Callback):
        def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: Tensor) -> None:
            counts.append(sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pl_module.modules()))

    _fit([mon, Count()], 4, tmp_path)
    assert counts[0] > 0 and counts[1:] == [0, 0, 0]  # step 0 is due (and only it)
