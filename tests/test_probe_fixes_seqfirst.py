"""A model whose own input is sequence-first (``[T, B, d]``, ``self.net(x.transpose(0, 1))`` in the training step):
dimension 0 of the call's first tensor is not the batch. The probe sees that the call's output stays as it is when
that dimension is sliced, and finds the dimension the output follows instead (``T == B`` or not); where it cannot
tell (an output sequence-first too), ``batch_dims`` declares it, also from ``GradientNoiseScaleMonitor``. It used
to take the time steps for the examples (``T == B``: norms off up to 283%, silently) or leave every layer out with
the wrong reason (``T != B``). Exact against a loop over examples, in ``Trainer.fit`` too."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor, PerExampleGradNorms
from test_probe_fixes_oracle import NoiseScaleOracle, assert_exact, loop_oracle

B = 6


class SeqFirstClassifier(nn.Module):
    """Takes ``[T, B, 5]``, pools over time: ``[B, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))).mean(0))


class SeqFirstTagger(nn.Module):
    """Takes ``[T, B, 5]``, returns ``[T, B, 3]``: with ``T == B`` nothing tells its batch dimension apart."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.inp(x)))


@pytest.mark.parametrize("strategy", ["auto", "gram"])
@pytest.mark.parametrize("batch_size", [None, B])
@pytest.mark.parametrize("t", [B, 4, 9])  # T == B (ambiguous by shape), T < B, T > B
def test_sequence_first_model_input_exact(t: int, batch_size: Optional[int], strategy: str) -> None:
    """With the batch's size known (``entry_batch_size``, as the noise-scale monitor sets it from each batch)."""
    torch.manual_seed(0)
    model = SeqFirstClassifier()
    x, y = torch.randn(t, B, 5), torch.randint(0, 3, (B,))
    with PerExampleGradNorms(model, batch_size=batch_size, linear_strategy=strategy) as probe:
        probe.entry_batch_size = B
        F.cross_entropy(model(x), y).backward()
    per = probe.per_parameter()
    assert probe.uncovered == []
    assert_exact(per, loop_oracle(model, F.cross_entropy, x, y, bdim=1))


def test_batch_first_model_with_square_input_stays_batch_first() -> None:
    """The same shapes batch-first (the output follows dimension 0): nothing changes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(B, B, 5), torch.randint(0, 3, (B, B))

    def ce(out: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(out.reshape(-1, 3), target.reshape(-1))

    with PerExampleGradNorms(model) as probe:
        ce(model(x), y).backward()
    assert probe.uncovered == []
    assert_exact(probe.per_parameter(), loop_oracle(model, ce, x, y))


def test_output_that_ignores_the_sliced_dimension_gives_the_reason() -> None:
    """Sequence-first with the batch packed with the features (``[T, B * 5]``, ``T != B``): no dimension of the
    argument holds the batch's examples: left out, with the reason."""

    class Packed(SeqFirstClassifier):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x.view(x.shape[0], -1, 5))

    torch.manual_seed(0)
    model = Packed()
    x, y = torch.randn(4, B * 5), torch.randint(0, 3, (B,))
    with PerExampleGradNorms(model, batch_size=B) as probe:
        probe.entry_batch_size = B
        F.cross_entropy(model(x), y).backward()
    assert probe.per_parameter() == {}
    assert len(probe.uncovered) == 6
    assert f"the batch's {B} examples along no dimension" in probe.reasons["inp.weight"]
    assert "batch_dims" in probe.reasons["inp.weight"]


@pytest.mark.parametrize("pooled", [False, True])
def test_batch_first_model_whose_output_does_not_follow_the_batch_stays_exact(pooled: bool) -> None:
    """A batch-first model returning a per-position loss averaged over the batch (``[T]``) or a vector pooled over the
    batch (``[C]``, ``C == B``): slicing dimension 0 leaves the output's shape as it is, as for a sequence-first
    input, but dimension 0 holds the batch's examples: it stays the batch (it was taken for time steps, or every layer
    was left out)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, B if pooled else 3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Tensor) -> Tensor:
            out = self.net(x)  # [B, T, B] pooled, [B, T, 3] not
            return out.mean((0, 1)) if pooled else out.pow(2).mean((0, 2))

    model = Model()
    x = torch.randn(B, 4, 5)

    def loss_fn(out: Tensor, _: Tensor) -> Tensor:
        return out.sum()

    y = torch.zeros(B)
    with PerExampleGradNorms(model, batch_size=B) as probe:
        probe.entry_batch_size = B
        loss_fn(model(x), y).backward()
    assert probe.uncovered == []
    # the loss is a mean over the batch: each example's gradient is B times its share
    ref = {n: v for n, v in loop_oracle(model, loss_fn, x, y).items()}
    assert_exact(probe.per_parameter(), ref)


def test_sequence_first_output_with_other_length_is_left_out_with_the_reason() -> None:
    """Input and output sequence-first, ``T != B``: dimension 0 follows the slice and is taken for the batch; the
    count of examples (``batch_size``, as the monitor passes it) says it is not, and the modules are left out."""
    torch.manual_seed(0)
    model = SeqFirstTagger()
    x, y = torch.randn(4, B, 5), torch.randint(0, 3, (B, 4))
    with PerExampleGradNorms(model, batch_size=B) as probe:
        loss_of(model(x), y).backward()
    assert probe.per_parameter() == {}
    assert sorted(probe.uncovered) == ["inp.bias", "inp.weight", "out.bias", "out.weight"]
    assert f"the batch's {B} examples (it gave 4 rows" in probe.reasons["inp.weight"]
    with PerExampleGradNorms(model, batch_size=B, batch_dims={"*": 1}) as probe:  # declared: exact
        loss_of(model(x), y).backward()
    assert probe.uncovered == []
    assert_exact(probe.per_parameter(), loop_oracle(model, loss_of, x, y, bdim=1))


class _SeqFirstStep(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch  # x: [B, T, 5] from the loader
        return loss_of(self.net(x.transpose(0, 1)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loss_of(out: Tensor, y: Tensor) -> Tensor:
    if out.dim() == 3:  # the tagger: [T, B, 3] against y [B, T]
        return F.cross_entropy(out.transpose(0, 1).reshape(-1, 3), y.reshape(-1))
    return F.cross_entropy(out, y)


def fit(net: nn.Module, t: int, tmp_path: Any, **kw: Any) -> tuple[GradientNoiseScaleMonitor, NoiseScaleOracle, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * B, t, 5, generator=g)
    y = torch.randint(0, 3, (8 * B, t) if isinstance(net, SeqFirstTagger) else (8 * B,), generator=g)
    mon = GradientNoiseScaleMonitor(method="per_example", every_n_steps=1, smoothing=0.0, per_layer=False, **kw)
    oracle = NoiseScaleOracle(mon, loss_of, lambda m, xi: m.net(xi.transpose(0, 1)))
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[oracle, mon],
                         default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_SeqFirstStep(net), DataLoader(TensorDataset(x, y), batch_size=B))
    return mon, oracle, trainer


@pytest.mark.parametrize("t", [B, 5])
def test_fit_with_a_sequence_first_model_exact(t: int, tmp_path) -> None:
    torch.manual_seed(0)
    mon, oracle, trainer = fit(SeqFirstClassifier(), t, tmp_path)
    assert mon._probe.uncovered == []
    assert float(trainer.callback_metrics["gns/coverage"]) == 1.0
    assert len(oracle.rows) == 4 and oracle.worst() < 1e-3


def test_fit_batch_dims_declared_on_the_monitor_exact(tmp_path) -> None:
    """Input and output sequence-first with ``T == B``: not to be told from shapes; declared from the monitor."""
    torch.manual_seed(0)
    mon, oracle, _ = fit(SeqFirstTagger(), B, tmp_path, batch_dims={"net.*": 1})
    assert mon._probe.batch_dims == {"net.*": 1}
    assert mon._probe.uncovered == []
    assert len(oracle.rows) == 4 and oracle.worst() < 1e-3


@pytest.mark.parametrize("bad", [{"net": -1}, {"net": 1.5}, {3: 0}, ["net"], {"net": True}])
def test_monitor_batch_dims_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match="batch_dims"):
        GradientNoiseScaleMonitor(batch_dims=bad)


class SeqFirstFixedLength(SeqFirstClassifier):
    """A sequence-first classifier with learned positions of a fixed length ``[T, 1, 8]``: slicing its input's dimension
    0 (the time steps) makes the model fail, so the probe's first try on a slice raises."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(t, 1, 8) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x) + self.pos))).mean(0))


def test_fit_with_a_sequence_first_model_that_fails_on_a_slice_of_its_time_steps_exact(tmp_path) -> None:
    """The slice of dimension 0 raises (the positions no longer add up); with the batch's size known the probe tries
    the other dimension of that size and finds the batch there. Every layer was left out (coverage 0) before."""
    torch.manual_seed(0)
    mon, oracle, trainer = fit(SeqFirstFixedLength(5), 5, tmp_path)
    assert mon._probe.uncovered == ["net.pos"]  # a bare parameter of the model: no handler, by rule
    assert {"net.inp.weight", "net.mid.weight", "net.out.weight"} <= set(mon._probe.covered)
    assert 0.0 < float(trainer.callback_metrics["gns/coverage"]) < 1.0
    assert len(oracle.rows) == 4 and oracle.worst() < 1e-3
