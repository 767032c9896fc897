"""A known limit of the slow-climb rule: a language model trained from 4.2 (ln 64) to 1.4 whose rate is ramped x300
doubles its loss over 15 steps and settles 9% above its matched control. The rule asks for a rise of a quarter of the
initial loss (1.04), so the run gets one `loss_creep` warning and no action. A quarter of the lowest smoothed loss
instead caught it (and 7 of the 11 such Llama runs missed), but rolled back healthy runs and controls the rule was not tuned on
(13 of 114 small-batch, BatchNorm, Lookahead and stochastic-depth runs, and a held-out control of the zoo), so the
quarter of the initial loss stays (docs/divergence_guard.md, known limits)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_monitor import DivergenceGuard

transformers = pytest.importorskip("transformers")

V, T, B, STEPS = 64, 32, 16, 240


def _markov(n: int, seed: int) -> torch.Tensor:
    """Order-1 chain with two likely successors per token and 10% noise."""
    succ = torch.randint(1, V, (V, 2), generator=torch.Generator().manual_seed(1000 + seed))
    g = torch.Generator().manual_seed(seed * 100)
    x = torch.zeros(n, T, dtype=torch.long)
    x[:, 0] = torch.randint(1, V, (n,), generator=g)
    x[:, 1] = torch.randint(1, V, (n,), generator=g)
    for t in range(2, T):
        r = torch.rand(n, generator=g)
        nxt = succ[x[:, t - 1], (r > 0.75).long()]
        x[:, t] = torch.where(r < 0.1, torch.randint(1, V, (n,), generator=g), nxt)
    return x


class _TinyLlama(pl.LightningModule):
    def __init__(self, peak: float) -> None:
        super().__init__()
        self.peak = peak
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=64))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch, attention_mask=torch.ones_like(batch)).logits[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.ndim >= 2]
        others = [p for p in self.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                                lr=3e-3, betas=(0.9, 0.95))

        def rate(step: int) -> float:  # warm-up, cosine, and the ramp over steps 144-164, held
            base = (step + 1) / 20 if step < 20 else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - 20) / (STEPS - 20)))
            return base * (self.peak ** min(1.0, (step - 144) / 20) if step >= 144 else 1.0)

        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, rate),
                                                   "interval": "step"}}


def _fit(peak: float) -> tuple[DivergenceGuard, _TinyLlama]:
    pl.seed_everything(0, workers=True, verbose=False)
    module, guard = _TinyLlama(peak), DivergenceGuard()
    data = DataLoader(_markov(STEPS * B, 0), batch_size=B, shuffle=True, generator=torch.Generator().manual_seed(0),
                      drop_last=True)
    pl.Trainer(max_steps=STEPS, accelerator="cpu", gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[guard]).fit(module, data)
    return guard, module


@pytest.mark.xfail(strict=True, reason="known limit: a slow climb is judged against a quarter of the initial loss")
def test_a_language_model_climbing_from_its_trained_level_is_rolled_back() -> None:
    guard, module = _fit(300.0)
    assert guard.rollbacks and guard.stopped_step is None
    assert 160 <= guard.rollbacks[0]["step"] <= 175 and guard.rollbacks[0]["to_step"] <= 160
    assert sum(module.losses[-10:]) / 10 < 1.45  # unguarded 1.497; the control (x2) 1.374


def test_its_matched_control_takes_no_action() -> None:
    guard, _ = _fit(2.0)
    assert not guard.rollbacks and guard.stopped_step is None
