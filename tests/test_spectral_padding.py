"""Spectral alignment on padded batches: the positions the batch's attention mask leaves out are no input rows, so
the sign diversity is that of the real tokens (a changing share of padding moved it, and raised `collapse`)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_monitor import SpectralAlignmentMonitor
from lightning_monitor.functional import sign_diversity, spectral_alignment
from lightning_monitor.probes.inputs import InputCapture

transformers = pytest.importorskip("transformers")

V, T, B = 100, 32, 16


class _Batches(Dataset):
    """Masked-LM batches as dicts (Hugging Face's layout): full-length sequences for ``full`` steps, then sequences
    of 6-9 tokens padded to ``T`` (about 75% padding)."""

    def __init__(self, full: int, short: int) -> None:
        g = torch.Generator().manual_seed(1)
        n = (full + short) * B
        ids = torch.randint(1, V, (n, T), generator=g)
        mask = torch.ones(n, T, dtype=torch.long)
        for i, length in enumerate(torch.randint(6, 10, (short * B,), generator=g)):
            mask[full * B + i, length:] = 0
        self.ids, self.mask = ids.masked_fill(mask == 0, 0), mask

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.ids[i].masked_fill(self.mask[i] == 0, -100)}


class _MLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=T, pad_token_id=0,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.model = transformers.BertForMaskedLM(cfg)

    def training_step(self, batch, batch_idx):
        self.mask = batch["attention_mask"]
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _RealTokens(pl.Callback):
    """The oracle: every input row of each watched layer on due steps, and ``D`` over the real tokens against the
    top right singular vector of a full SVD (listed after the monitor, which measured before this hook)."""

    def __init__(self, monitor: SpectralAlignmentMonitor) -> None:
        self.monitor, self.rows, self.handles, self.expected, self.logged = monitor, {}, [], {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.monitor.is_due(trainer.global_step):
            for n in self.monitor.layers:
                self.handles.append(pl_module.get_submodule(n).register_forward_pre_hook(
                    lambda m, a, n=n: self.rows.__setitem__(n, a[0].detach())))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for h in self.handles:
            h.remove()
        self.handles = []
        if not self.rows:
            return
        keep = pl_module.mask.bool().reshape(-1)
        for n, x in self.rows.items():
            v1 = torch.linalg.svd(pl_module.get_submodule(n).weight.detach().double()).Vh[0]
            self.expected[(trainer.global_step, n)] = float(sign_diversity(spectral_alignment(x.reshape(-1, x.shape[-1]), v1)[keep]))
        self.rows = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        for n in self.monitor.layers:
            v = trainer.callback_metrics.get(f"sa/{n}/sign_diversity")
            if (step, n) in self.expected and v is not None:
                self.logged[(step, n)] = float(v)


def _fit(tmp_path, monitor, callbacks=(), steps=100, full=60):
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                         callbacks=[monitor, *callbacks])
    trainer.fit(_MLM(), DataLoader(_Batches(full, steps - full), batch_size=B))


def test_padding_positions_are_no_rows_and_d_is_the_real_tokens(tmp_path):
    """The batch's ``attention_mask`` read by default: each layer's logged ``D`` is the oracle's over the real tokens
    (every row kept: ``max_rows`` above the batch's positions; the oracle's vector from a full SVD), and a padding share from 0 to 75% at step 60 raises no
    `collapse` (it did at step 80, ``D`` over all positions from 0.46 to 0.28)."""
    monitor = SpectralAlignmentMonitor(every_n_steps=5, max_rows=100_000)
    oracle = _RealTokens(monitor)
    _fit(tmp_path, monitor, [oracle])
    assert len(oracle.logged) >= 19 * len(monitor.layers) and oracle.logged.keys() <= oracle.expected.keys()
    # up to a row or two where the warm power iteration's vector is within its tolerance of the SVD's (a cosine near
    # 0 takes the other sign); over all positions the padded phase's D was 0.17 lower
    for key, value in oracle.logged.items():
        assert value == pytest.approx(oracle.expected[key], abs=0.04), key  # 2 rows of the ~100 tokens of a padded batch
    diffs = [abs(v - oracle.expected[k]) for k, v in oracle.logged.items()]
    assert sum(diffs) / len(diffs) < 3e-3
    assert not [a for a in monitor.hub.history if a.kind == "collapse"]

    every = SpectralAlignmentMonitor(every_n_steps=5, max_rows=100_000, row_mask=None)  # every position a row
    _fit(tmp_path, every)
    assert [a.step for a in every.hub.history if a.kind == "collapse"]


def test_a_sample_of_masked_rows_draws_only_the_tokens():
    """``max_rows`` of the masked positions, uniformly, on the device; with fewer tokens than ``max_rows`` the rest of
    the sample is NaN rows (no sign), never a padding row."""
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3) + 1
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    capture = InputCapture({}, max_rows=4)
    capture.row_mask = mask
    rows = capture.sample(x, capture._mask_for(x))
    tokens = {tuple(r.tolist()) for r in x[mask]}
    assert rows.shape == (4, 3) and {tuple(r.tolist()) for r in rows} <= tokens and len({tuple(r.tolist()) for r in rows}) == 4
    capture = InputCapture({}, max_rows=8)
    capture.row_mask = mask
    rows = capture.sample(x.transpose(0, 1).contiguous(), capture._mask_for(x.transpose(0, 1)))  # sequence first
    finite = rows[~rows.isnan().any(1)]
    assert rows.shape == (8, 3) and {tuple(r.tolist()) for r in finite} == tokens and rows.isnan().all(1).sum() == 3


def test_the_micro_batches_of_a_step_give_a_uniform_sample_of_all_their_tokens():
    """Two calls of a layer in one step (the micro-batches of an accumulated step), padded differently: 10 tokens of
    100 positions, then 100 of 100. A sample of 50 rows is a uniform one of the 110 tokens (10/110 of its rows from the
    first call, no padding row); weighed by positions, the first call's few tokens were drawn twice as often."""
    torch.manual_seed(0)
    first, second = torch.randn(1, 100, 4) + 10.0, torch.randn(1, 100, 4) - 10.0  # told apart by their sign
    mask_first = torch.zeros(1, 100, dtype=torch.bool)
    mask_first[0, :10] = True
    shares = []
    capture = InputCapture({"lin": torch.nn.Linear(4, 4)}, max_rows=50, seed=0)
    for _ in range(200):
        capture.arm()
        layer = capture.modules["lin"]
        capture.row_mask = mask_first
        layer(first)
        capture.row_mask = torch.ones(1, 100, dtype=torch.bool)
        layer(second)
        rows = capture.take()["lin"]
        assert rows.shape == (50, 4) and not rows.isnan().any()
        shares.append(float((rows[:, 0] > 0).float().mean()))
    assert abs(sum(shares) / len(shares) - 10 / 110) < 0.01
