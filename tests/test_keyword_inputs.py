"""Layers called with their input by keyword (``layer(input=x)``, the parameter's name of ``nn.Linear``, the
convolutions, ``nn.Embedding`` and the norms): the per-example probe's fused forwards took it positionally only
(a ``TypeError`` stopped the fit), its hooks, SA's input capture and GWA's head hooks saw no input (the layers were
said not to run, GWA scored nothing and said nothing). Each is now read as the positional call."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from test_per_example import check
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_monitor as lm


class KeywordConvNet(nn.Module):
    """A Conv1d, an Embedding-free sequence MLP and a head, each called as ``layer(input=...)`` or positionally."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.norm = nn.LayerNorm(6)
        self.a = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def call(self, layer: nn.Module, x: Tensor) -> Tensor:
        return layer(input=x) if self.keyword else layer(x)

    def forward(self, x: Tensor) -> Tensor:
        h = self.call(self.conv, x.transpose(1, 2)).transpose(1, 2)
        h = torch.tanh(self.call(self.a, self.call(self.norm, h))).mean(1)
        return self.call(self.head, h)


@pytest.mark.parametrize("strategy", ["auto", "fused", "gram", "materialize"])
def test_probe_is_exact_on_layers_called_by_keyword(strategy: str) -> None:
    torch.manual_seed(0)
    model = KeywordConvNet(keyword=True)
    x, y = torch.randn(5, 7, 6), torch.randint(0, 3, (5,))
    probe = check(model, F.cross_entropy, x, y, linear_strategy=strategy)
    assert probe.uncovered == []
    assert len(probe.covered) == len(list(model.parameters()))


class Net(pl.LightningModule):
    def __init__(self, keyword: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = KeywordConvNet(keyword)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(keyword: bool, tmp_path) -> tuple[dict[str, float], list]:
    torch.manual_seed(1)
    x, y = torch.randn(48, 7, 6), torch.randint(0, 3, (48,))
    monitors = [lm.SpectralAlignmentMonitor(every_n_steps=2, warmup_steps=0),
                lm.GradientNoiseScaleMonitor(every_n_steps=2, method="per_example"),
                lm.GradientWeightAlignmentMonitor()]
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=monitors,
                         default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(keyword), DataLoader(TensorDataset(x, y), batch_size=8))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("sa/", "gns/", "gwa/"))}
    alerts = [(a.monitor, a.kind, a.step) for a in monitors[0].hub.history]
    return metrics, alerts


def test_monitors_read_layers_called_by_keyword_as_positional_ones(tmp_path) -> None:
    positional, said_positional = _fit(False, tmp_path / "p")
    keyword, said_keyword = _fit(True, tmp_path / "k")
    assert {"sa/net.a/sigma", "gns/coverage", "gns/g2", "gwa/mean", "gwa/kurtosis"} <= set(positional)
    assert positional["gns/coverage"] == 1.0
    assert keyword == pytest.approx(positional, rel=1e-5, abs=1e-7)
    assert said_keyword == said_positional


class _Attention(pl.LightningModule):
    def __init__(self, keyword: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.keyword = keyword
        self.inp = nn.Linear(6, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.inp(x)
        a = self.mha(query=h, key=h, value=h)[0] if self.keyword else self.mha(h, h, h)[0]
        return F.cross_entropy(self.head(a.mean(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_attention_called_with_query_by_keyword_is_aligned(tmp_path) -> None:
    """SA's input capture took only a keyword named `input`: `mha(query=h, key=h, value=h)` was said not to run
    (`layers_not_called`) and left out of every check. The first parameter of the module's own forward is read now."""
    got = {}
    for keyword in (False, True):
        torch.manual_seed(1)
        x, y = torch.randn(32, 5, 6), torch.randint(0, 3, (32,))
        mon = lm.SpectralAlignmentMonitor(every_n_steps=1, warmup_steps=0)
        trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=str(tmp_path / str(keyword)), callbacks=[mon])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_Attention(keyword), DataLoader(TensorDataset(x, y), batch_size=8))
        got[keyword] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("sa/")}
        assert "layers_not_called" not in {a.kind for a in mon.hub.history}
    assert any(k.startswith("sa/mha") for k in got[True])
    assert got[True] == pytest.approx(got[False], rel=1e-6, abs=1e-9)
