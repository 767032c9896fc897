"""nn.LSTM, nn.GRU and nn.RNN (lightning_monitor/probes/per_example/recurrent.py) against each example's own gradient,
taken by a loop over single examples (torch.func's vmap has no batching rule for the fused recurrent kernels)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import tb_scalars
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor, PerExampleGradNorms

TOL = 1e-4


class _Net(nn.Module):
    """A recurrent layer, its outputs pooled (and, with ``use_state``, its final state added), a Linear head."""

    def __init__(self, rnn: nn.Module, use_state: bool = False) -> None:
        super().__init__()
        self.rnn, self.use_state = rnn, use_state
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 3)

    def forward(self, x: torch.Tensor, h0=None) -> torch.Tensor:
        out, state = self.rnn(x) if h0 is None else self.rnn(x, h0)
        if not self.rnn.batch_first:
            out = out.transpose(0, 1)
        z = out.mean(1)
        if self.use_state:
            h = state[0] if isinstance(state, tuple) else state
            z = z + 0.5 * h[-1].repeat(1, 2 if self.rnn.bidirectional else 1)
            if isinstance(state, tuple):
                z = z + 0.1 * state[1][-1].sum(-1, keepdim=True)
        return self.head(z)


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor, h0=None) -> dict[str, torch.Tensor]:
    first = model.rnn.batch_first
    per: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(y.shape[0]):
        xi = x[i:i + 1] if first else x[:, i:i + 1]
        hi = None if h0 is None else tuple(h[:, i:i + 1] for h in h0) if isinstance(h0, tuple) else h0[:, i:i + 1]
        model.zero_grad()
        F.cross_entropy(model(xi, hi), y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            per[n].append(p.grad.detach().double().pow(2).sum())
    return {n: torch.stack(v) for n, v in per.items()}


def _probe(model: nn.Module, x: torch.Tensor, y: torch.Tensor, h0=None) -> PerExampleGradNorms:
    probe = PerExampleGradNorms(model, batch_size=y.shape[0])
    probe.entry_batch_size = y.shape[0]  # as the noise-scale monitor sets it: a sequence-first input is found
    model.zero_grad()
    with probe:
        F.cross_entropy(model(x, h0), y).backward()
    return probe


RNNS = {
    "lstm": lambda: nn.LSTM(5, 7, batch_first=True),
    "lstm_2_layers_bidirectional": lambda: nn.LSTM(5, 7, num_layers=2, bidirectional=True, batch_first=True),
    "lstm_sequence_first": lambda: nn.LSTM(5, 7, num_layers=2),
    "lstm_2_layers_dropout_eval": lambda: nn.LSTM(5, 7, num_layers=2, dropout=0.3, batch_first=True).eval(),
    "gru_bidirectional": lambda: nn.GRU(5, 6, bidirectional=True, batch_first=True),
    "gru_2_layers_no_bias": lambda: nn.GRU(5, 6, num_layers=2, bias=False, batch_first=True),
    "rnn_tanh_sequence_first": lambda: nn.RNN(5, 6, num_layers=2),
    "rnn_relu": lambda: nn.RNN(5, 6, nonlinearity="relu", batch_first=True),
}


@pytest.mark.parametrize("use_state", [False, True])
@pytest.mark.parametrize("kind", list(RNNS))
def test_recurrent_exact(kind: str, use_state: bool) -> None:
    torch.manual_seed(0)
    rnn = RNNS[kind]()
    model = _Net(rnn, use_state)
    x = torch.randn(6, 9, 5) if rnn.batch_first else torch.randn(9, 6, 5)
    y = torch.randint(0, 3, (6,))
    probe = _probe(model, x, y)
    assert probe.uncovered == []
    per, ref = probe.per_parameter(), _oracle(model, x, y)
    assert set(per) == set(ref)
    for name in per:
        err = ((per[name].double() - ref[name]).abs() / ref[name].clamp_min(1e-12)).max()
        assert float(err) <= TOL, name


class _FromState(nn.Module):
    """The initial state computed from the input (an encoder's summary handed to a decoder): ``hx`` given."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = cls(4, 5, num_layers=2, batch_first=True)
        self.init = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, h0=None) -> torch.Tensor:
        h = torch.tanh(self.init(x[:, 0])).unsqueeze(0).repeat(2, 1, 1)
        out, _ = self.rnn(x, (h, -h) if isinstance(self.rnn, nn.LSTM) else h)
        return self.head(out.mean(1))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_an_initial_state_given_exact(kind: str) -> None:
    torch.manual_seed(1)
    model = _FromState(kind)
    x, y = torch.randn(5, 7, 4), torch.randint(0, 3, (5,))
    probe = _probe(model, x, y)
    assert probe.uncovered == []
    per, ref = probe.per_parameter(), _oracle(model, x, y)
    assert set(per) == set(ref)
    for name in per:
        assert float(((per[name].double() - ref[name]).abs() / ref[name].clamp_min(1e-12)).max()) <= TOL, name


def test_the_module_outputs_are_those_of_the_plain_forward() -> None:
    torch.manual_seed(0)
    model = _Net(nn.LSTM(5, 7, num_layers=2, bidirectional=True, batch_first=True), use_state=True)
    x, y = torch.randn(4, 6, 5), torch.randint(0, 3, (4,))
    plain = model(x)
    F.cross_entropy(plain, y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    probe = PerExampleGradNorms(model, batch_size=4)
    with probe:
        watched = model(x)
        F.cross_entropy(watched, y).backward()
    assert torch.equal(plain, watched)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def test_dropout_between_layers_in_training_and_packed_sequences_are_left_out_with_the_reason() -> None:
    torch.manual_seed(0)
    model = _Net(nn.LSTM(5, 7, num_layers=2, dropout=0.3, batch_first=True))
    x, y = torch.randn(4, 6, 5), torch.randint(0, 3, (4,))
    probe = _probe(model, x, y)
    probe.per_parameter()  # the parameters no use was recorded for are found uncovered here
    assert sorted(probe.uncovered) == sorted(f"rnn.{n}" for n in model.rnn._flat_weights_names)
    assert "dropout between its layers" in probe.reasons["rnn.weight_ih_l0"]
    assert "head.weight" in probe.covered

    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.head = nn.GRU(5, 6, batch_first=True), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, h0=None) -> torch.Tensor:
            lengths = (x.abs().sum(-1) > 0).sum(1).cpu()  # zero-padded sequences
            _, h = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
            return self.head(h[-1])

    x = x * (torch.arange(6) < torch.tensor([6, 5, 3, 2])[:, None]).unsqueeze(-1)
    packed = Packed()
    probe = _probe(packed, x, y)
    probe.per_parameter()
    assert sorted(probe.uncovered) == sorted(f"rnn.{n}" for n in packed.rnn._flat_weights_names)
    assert "PackedSequence" in probe.reasons["rnn.weight_hh_l0"]
    assert "head.weight" in probe.covered


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        out, _ = self.rnn(batch[0])
        return F.cross_entropy(self.head(out[:, -1]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_an_lstm_classifier_is_wholly_covered_in_a_fit(tmp_path) -> None:
    """The noise-scale monitor on an LSTM classifier: coverage 1 (it was 0.52, the LSTM left out), read back from
    TensorBoard."""
    torch.manual_seed(0)
    x = torch.randn(128, 10, 8)
    y = (x.sum((1, 2)) > 0).long() + 2 * (x[:, -1, 0] > 0).long()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    monitor = GradientNoiseScaleMonitor(every_n_steps=2)
    pl.Trainer(max_steps=8, accelerator="cpu", logger=logger, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, log_every_n_steps=1, callbacks=[monitor]).fit(
        _Classifier(), DataLoader(TensorDataset(x, y), batch_size=16))
    scalars = tb_scalars(logger.log_dir)
    assert [v for _, v in scalars["gns/coverage"]] == [1.0] * 4
    assert len(scalars["gns/b_simple"]) >= 1
    assert os.path.isdir(logger.log_dir)


def test_a_replay_that_fails_leaves_the_layer_out_and_the_step_intact(monkeypatch) -> None:
    """The replay runs inside the probe's guard: an error there (weights it cannot read, as FSDP2's resharded ones)
    leaves the recurrent layer out with the error as the reason; the backward completes with the plain gradients."""
    import lightning_monitor.probes.per_example.recurrent as recurrent

    def broken(*args, **kwargs):
        raise RuntimeError("cannot read the weights")

    monkeypatch.setattr(recurrent, "_replay", broken)
    torch.manual_seed(0)
    model = _Net(nn.GRU(5, 6, batch_first=True))
    x, y = torch.randn(4, 6, 5), torch.randint(0, 3, (4,))
    F.cross_entropy(model(x), y).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    probe = _probe(model, x, y)
    per = probe.per_parameter()
    assert "head.weight" in per and not any(n.startswith("rnn.") for n in per)
    assert "cannot read the weights" in probe.reasons["rnn.weight_hh_l0"]
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, plain[n]), n


@pytest.mark.parametrize("batch_first", [False, True])
def test_a_declared_batch_dimension_is_read_on_the_layers_own_input(batch_first) -> None:
    # `batch_dims` names the dimension of the module's input that holds the batch: 1 for a sequence-first [T, B, d]
    # input. It was applied to the batch-first input the patched forward hands the probe, so the true dimension left
    # the layer out (with a shape it never received in the reason) and the wrong one (0) covered it
    torch.manual_seed(0)
    model = _Net(nn.GRU(5, 6, bidirectional=True, batch_first=batch_first))
    y = torch.randint(0, 3, (8,))
    x = torch.randn(8, 4, 5) if batch_first else torch.randn(4, 8, 5)
    true_dim = 0 if batch_first else 1
    ref = _oracle(model, x, y)
    probe = PerExampleGradNorms(model, batch_dims={"rnn": true_dim, "head": 0})
    model.zero_grad()
    with probe:
        F.cross_entropy(model(x), y).backward()
    assert probe.uncovered == []
    per = probe.per_parameter()
    for name in ref:
        err = (per[name].double() - ref[name]).abs() / ref[name].clamp_min(1e-12)
        assert float(err.max()) <= TOL, name
    wrong = PerExampleGradNorms(model, batch_dims={"rnn": 1 - true_dim, "head": 0})
    model.zero_grad()
    with wrong:
        F.cross_entropy(model(x), y).backward()
    reason = wrong.reasons["rnn.weight_ih_l0"]
    assert f"dimension {1 - true_dim} of its input" in reason and "own dimensions" in reason


class _PaddedTagger(nn.Module):
    """A GRU whose padded steps are zeroed in place in its output (the model's own write, after the layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(5, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        out.masked_fill_((torch.arange(x.shape[1])[None, :] >= lengths[:, None])[..., None], 0.0)
        return self.head(out.sum(1) / lengths[:, None])


def test_an_output_written_in_place_is_measured_exactly() -> None:
    """The model zeroes the padded steps of the GRU's output in place: the armed probe neither breaks that write
    (it crashed on the views an identity Function returned) nor miscounts it (each example's norm by its own
    backward)."""
    torch.manual_seed(0)
    model = _PaddedTagger()
    x, lengths, y = torch.randn(6, 7, 5), torch.tensor([7, 3, 5, 1, 7, 2]), torch.randint(0, 3, (6,))
    ref: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(6):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1], lengths[i:i + 1]), y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            ref[n].append(p.grad.double().pow(2).sum())
    probe = PerExampleGradNorms(model, batch_size=6)
    model.zero_grad()
    with probe:
        F.cross_entropy(model(x, lengths), y).backward()
    per = probe.per_parameter()
    assert probe.uncovered == []
    for n, values in ref.items():
        torch.testing.assert_close(per[n].double(), torch.stack(values), rtol=TOL, atol=1e-9)
