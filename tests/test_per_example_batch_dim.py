"""Which input dimension holds the batch: sequence-first inputs, positions broadcast over the batch
(also when their length equals the batch size), activation checkpointing, sparse gradients; every case
against per-example gradients from torch.func, or listed as uncovered with its reason."""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_per_example import TinyTransformer, ce_seq, check, oracle, probe_run
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_monitor import PerExampleGradNorms


class SeqFirst(nn.Module):
    """Takes ``[B, T, d]``, runs its middle Linear sequence-first on ``[T, B, d]``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # [T, B, d]
        h = torch.tanh(self.mid(h)).transpose(0, 1)
        return self.out(h)


class BroadcastPositions(nn.Module):
    """A Linear applied to position features ``[T, d]`` broadcast over the batch."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.register_buffer("pos_feat", torch.randn(t, 4))
        self.pos = nn.Linear(4, 6)
        self.inp = nn.Linear(5, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.inp(x) + self.pos(self.pos_feat[: x.shape[1]])))


@pytest.mark.parametrize("t", [4, 6])  # T == B (ambiguous by shape) and T != B
def test_sequence_first_linear_exact(t: int) -> None:
    torch.manual_seed(0)
    model = SeqFirst()
    x, y = torch.randn(4, t, 5), torch.randint(0, 3, (4, t))
    probe = check(model, ce_seq, x, y)
    assert probe.uncovered == []


@pytest.mark.parametrize("strategy", ["auto", "gram"])  # fused (auto) and plain-hook paths
def test_sequence_first_square_fused_and_plain(strategy: str) -> None:
    torch.manual_seed(1)
    model = SeqFirst()
    x, y = torch.randn(5, 5, 5), torch.randint(0, 3, (5, 5))
    assert check(model, ce_seq, x, y, linear_strategy=strategy).uncovered == []


@pytest.mark.parametrize("t", [4, 6])
def test_linear_on_broadcast_positions_listed_uncovered(t: int) -> None:
    torch.manual_seed(0)
    model = BroadcastPositions(8)
    x, y = torch.randn(4, t, 5), torch.randint(0, 3, (4, t))
    probe = check(model, ce_seq, x, y)  # the rest stays exact
    assert sorted(probe.uncovered) == ["pos.bias", "pos.weight"]
    assert "no batch dimension" in probe.reasons["pos.weight"] or "batch" in probe.reasons["pos.weight"]


def test_embedding_of_positions_with_length_equal_to_batch_listed_uncovered() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(broadcast_pos=True)  # pos(arange(T)), T = 7
    x, y = torch.randint(0, 11, (7, 7)), torch.randint(0, 11, (7, 7))
    probe = check(model, ce_seq, x, y)
    assert probe.uncovered == ["pos.weight"]
    assert "no batch dimension" in probe.reasons["pos.weight"]
    # verify=False does not bring it back: the batch dimension is found independently of the check
    assert probe_run(model, ce_seq, x, y, verify=False).uncovered == ["pos.weight"]


def test_example_gpt_with_batch_size_equal_to_block_size() -> None:
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, n_layer=1, d_model=16, n_head=2))
    x, y = torch.randint(0, 40, (8, 8)), torch.randint(0, 40, (8, 8))
    probe = check(model, ce_seq, x, y)
    assert probe.uncovered == ["pos_emb.weight"]
    assert "no batch dimension" in probe.reasons["pos_emb.weight"]
    assert len(probe.covered) == len(list(model.parameters())) - 1


def test_batch_dims_declared() -> None:
    torch.manual_seed(0)
    model = BroadcastPositions(8)
    x, y = torch.randn(4, 4, 5), torch.randint(0, 3, (4, 4))
    probe = check(model, ce_seq, x, y, batch_dims={"pos": None, "*": 0})
    assert sorted(probe.uncovered) == ["pos.bias", "pos.weight"]
    assert "declared" in probe.reasons["pos.weight"]
    with pytest.raises(ValueError, match="batch_dims"):
        PerExampleGradNorms(model, batch_dims={"pos": -1})


def test_model_failing_on_a_smaller_batch_is_listed_uncovered() -> None:
    class FixedBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 4)

        def forward(self, x: Tensor) -> Tensor:
            if x.shape[0] != 6:
                raise ValueError("this model takes batches of 6")
            return self.a(x)

    model = FixedBatch()
    probe = probe_run(model, F.cross_entropy, torch.randn(6, 3), torch.randint(0, 4, (6,)))
    assert probe.per_parameter() == {}
    assert sorted(probe.uncovered) == ["a.bias", "a.weight"]
    assert "batches of 6" in probe.reasons["a.weight"] and "batch_dims" in probe.reasons["a.weight"]


def test_batch_size_run_leaves_no_trace() -> None:
    """The small run restores buffers (BatchNorm statistics) and the random state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 3))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    twin = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 3))
    twin.load_state_dict(model.state_dict())
    torch.manual_seed(5)
    F.cross_entropy(twin(x), y).backward()
    after = torch.rand(1)
    torch.manual_seed(5)
    probe = probe_run(model, F.cross_entropy, x, y)
    assert torch.equal(torch.rand(1), after)
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert sorted(probe.uncovered) == ["0.bias", "0.weight", "1.bias", "1.weight"]  # 0 feeds the BatchNorm
    assert "batch statistics" in probe.reasons["1.weight"]


class KeepsState(nn.Module):
    """A forward with side effects on the model: an auxiliary loss kept as an attribute (read by the training step,
    as mixture-of-experts routers do), an attribute set on the first call only, a list appended to and a count
    updated in place (a metric)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.gate, self.head = nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(6, 3)
        self.sizes: list[int] = []
        self.count = torch.zeros(())
        self.recent: deque = deque(maxlen=4)
        self.by_size: defaultdict = defaultdict(list)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.body(x))
        self.aux_loss = self.gate(h).softmax(-1).pow(2).sum(-1).mean()
        if not hasattr(self, "first_batch"):
            self.first_batch = x.shape[0]
        self.sizes.append(x.shape[0])
        self.count += x.shape[0]
        self.recent.append(x.shape[0])
        self.by_size["seen"].append(x.shape[0])  # a list inside a dict
        self.draw = torch.rand(1, generator=self.gen)  # the model's own generator
        self.np_draw = np.random.rand()  # numpy's global state (Hugging Face's SpecAugment masks draw from it)
        return self.head(h)


def test_batch_size_run_leaves_the_models_attributes_as_they_were() -> None:
    # the run on a slice came after the real forward and overwrote `aux_loss` with the slice's, computed without
    # gradients: the training step added a constant and the router got no gradient
    torch.manual_seed(0)
    model = KeepsState()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    twin = KeepsState()  # the same forward, no probe: the draws it makes
    np.random.seed(3)
    twin(x)
    twin_draws = [float(twin.draw), twin.np_draw, float(torch.rand(1, generator=twin.gen)), np.random.rand()]
    np.random.seed(3)
    with PerExampleGradNorms(model) as probe:
        loss = F.cross_entropy(model(x), y)
        assert model.aux_loss.requires_grad and model.sizes == [8] and float(model.count) == 8.0
        assert "first_batch" in vars(model) and model.first_batch == 8
        assert list(model.recent) == [8] and model.by_size == {"seen": [8]}
        assert [float(model.draw), model.np_draw, float(torch.rand(1, generator=model.gen)), np.random.rand()] == twin_draws
        (loss + model.aux_loss).backward()
    assert model.gate.weight.grad is not None and float(model.gate.weight.grad.abs().sum()) > 0
    assert probe.uncovered == []  # the slice did run: every layer's batch dimension was found
    per = probe.per_parameter()
    for i in range(len(x)):  # the oracle: each example's loss on its own
        twin = KeepsState()
        twin.load_state_dict(model.state_dict())
        (F.cross_entropy(twin(x[i:i + 1]), y[i:i + 1]) + twin.aux_loss).backward()
        for name, p in twin.named_parameters():
            torch.testing.assert_close(float(per[name][i]), float(p.grad.pow(2).sum()), rtol=1e-4, atol=1e-10)


def test_batch_size_run_of_the_lightning_module_logs_nothing(tmp_path) -> None:
    """Under DDP and FSDP Lightning calls the LightningModule itself to run `training_step`, so the probe's run on a
    slice runs the user's step: what it logs must not replace what the step logged (here a forward that logs, the
    same entry in one process)."""
    import csv
    import os

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_monitor import GradientNoiseScaleMonitor

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
            self.losses: list[float] = []

        def forward(self, x: Tensor, y: Tensor) -> Tensor:
            loss = F.cross_entropy(self.net(x), y)
            self.log("train/loss", loss)
            self.losses.append(float(loss))
            return loss

        def training_step(self, batch, batch_idx):
            return self(*batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    module, logger = Lit(), CSVLogger(tmp_path)
    gns = GradientNoiseScaleMonitor(every_n_steps=1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[gns])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        logged = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(module.losses) == 4  # the slice's call left no trace
    assert logged == pytest.approx(module.losses, rel=1e-6)
    assert gns._probe is not None and "net.0.weight" in gns._probe.covered


# ----------------------------------------------------------------------------- activation checkpointing


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b, self.n, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def segment(self, h: Tensor) -> Tensor:
        return self.n(torch.tanh(self.b(h)))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        if self.reentrant is None:
            h = self.segment(h)
        else:
            h = checkpoint(self.segment, h, use_reentrant=self.reentrant)
        return self.c(h)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("strategy", ["auto", "gram"])
def test_activation_checkpointing_exact(reentrant: bool, strategy: str) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    plain = Checkpointed(None)  # torch.func does not run checkpointed code: the oracle runs the same weights
    plain.load_state_dict(model.state_dict())
    x, y = torch.randn(5, 4, 6), torch.randint(0, 3, (5, 4))
    if reentrant:
        x.requires_grad_(True)  # the reentrant form needs an input that requires a gradient
    probe = probe_run(model, ce_seq, x, y, linear_strategy=strategy)
    ref = oracle(plain, ce_seq, x.detach(), y)
    assert probe.uncovered == []
    per = probe.per_parameter()
    assert set(per) == set(ref)
    for name, value in per.items():
        torch.testing.assert_close(value.double(), ref[name], rtol=1e-4, atol=1e-10)


# ----------------------------------------------------------------------------- sparse gradients


def test_sparse_embedding_exact_with_verification() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 3))
    x, y = torch.randint(0, 10, (5, 3)), torch.randint(0, 3, (5, 3))
    probe = probe_run(model, ce_seq, x, y)
    dense = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
    dense.load_state_dict(model.state_dict())
    ref = oracle(dense, ce_seq, x, y)
    assert probe.uncovered == []
    for name, value in probe.per_parameter().items():
        torch.testing.assert_close(value.double(), ref[name], rtol=1e-4, atol=1e-10)
    assert model[0].weight.grad.is_sparse


class CheckpointedConv(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b, self.head = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 6, 3, stride=2), nn.Linear(6, 3)

    def segment(self, h: Tensor) -> Tensor:
        return torch.tanh(self.b(h))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        h = self.segment(h) if self.reentrant is None else checkpoint(self.segment, h, use_reentrant=self.reentrant)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_of_fused_convolutions_exact(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = CheckpointedConv(reentrant)
    plain = CheckpointedConv(None)
    plain.load_state_dict(model.state_dict())
    x, y = torch.randn(5, 3, 8, 8), torch.randint(0, 3, (5,))
    if reentrant:
        x.requires_grad_(True)
    probe = probe_run(model, F.cross_entropy, x, y)
    ref = oracle(plain, F.cross_entropy, x.detach(), y)
    assert probe.uncovered == []
    for name, value in probe.per_parameter().items():
        torch.testing.assert_close(value.double(), ref[name], rtol=1e-4, atol=1e-10)


def test_a_dataclass_batch_passed_whole_is_sliced_through_its_fields() -> None:
    """``model(batch)`` with a dataclass holding the tensors: its batch size and the slice for the batch-size run are
    found through its fields (it was 'no tensor argument': every parameter left out)."""
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        note: str = "kept"

    class OnBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, batch: Batch) -> torch.Tensor:
            assert batch.note == "kept"
            return self.b(torch.tanh(self.a(batch.x)))

    torch.manual_seed(0)
    model = OnBatch()
    x, y = torch.randn(5, 7, 4), torch.randint(0, 3, (5, 7))
    with PerExampleGradNorms(model) as probe:
        F.cross_entropy(model(Batch(x)).reshape(-1, 3), y.reshape(-1)).backward()
    per = probe.per_parameter()
    assert probe.uncovered == [] and set(per) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():  # each example's own loss, one at a time
        ref = torch.stack([torch.autograd.grad(F.cross_entropy(model(Batch(x[i:i + 1])).reshape(-1, 3),
                                                               y[i:i + 1].reshape(-1)) * (7 / 35) * 5, p)[0].pow(2).sum()
                           for i in range(5)])
        torch.testing.assert_close(per[name], ref, rtol=1e-4, atol=1e-8)


class _LayerDrop(nn.Module):
    """Residual Linear blocks on sequences, each skipped at random in training mode (LayerDrop, as BART's and
    wav2vec2's encoders do); ``force``: the blocks to run, for the oracle; ``ran``: the blocks the last forward ran."""

    def __init__(self, p: float = 0.4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.head = nn.Linear(8, 3)
        self.p, self.force, self.ran = p, None, []

    def forward(self, x: Tensor) -> Tensor:
        ran = []
        for i, block in enumerate(self.blocks):
            keep = i in self.force if self.force is not None else not (self.training and float(torch.rand(())) < self.p)
            if keep:
                x = x + torch.tanh(block(x))
                ran.append(i)
        self.ran = ran
        return self.head(x).mean(1)


def test_layers_skipped_at_random_are_measured_where_they_ran() -> None:
    # the run on a slice of the batch draws its own skips: a block the real forward ran and the slice's run skipped
    # "runs a different number of times on a smaller batch" and stayed out for the whole fit (BART with LayerDrop 0.3:
    # 4 of 12 layers). Such calls are now compared with a run in eval mode, where nothing is skipped
    torch.manual_seed(3)
    model = _LayerDrop()
    x, y = torch.randn(6, 5, 8), torch.randint(0, 3, (6,))
    with PerExampleGradNorms(model) as probe:
        F.cross_entropy(model(x), y).backward()
    ran = list(model.ran)
    assert 0 < len(ran) < 6
    assert not any("different number of times" in why for why in probe.reasons.values()), probe.reasons
    norms = probe.per_parameter()
    model.force = ran
    for i in ran:
        for kind in ("weight", "bias"):
            name = f"blocks.{i}.{kind}"
            p = dict(model.named_parameters())[name]
            expected = torch.stack([torch.autograd.grad(F.cross_entropy(model(x[j:j + 1]), y[j:j + 1]), p)[0].pow(2).sum()
                                    for j in range(len(x))])
            torch.testing.assert_close(norms[name], expected, rtol=1e-4, atol=1e-10)


class _SliceOfBatch(nn.Module):
    """A block run on the first 4 examples of the batch only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        k = min(4, x.shape[0])
        return self.head(torch.cat([h[:k] + torch.tanh(self.extra(h[:k])), h[k:]], 0))


def test_a_layer_run_on_a_slice_of_the_batch_is_left_out_with_that_reason() -> None:
    # its reason said the batch was "folded ... together with other positions", which it is not
    model = _SliceOfBatch()
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    with PerExampleGradNorms(model) as probe:
        F.cross_entropy(model(x), y).backward()
    assert "extra.weight" in probe.uncovered
    assert "4 rows for the batch's 8 examples" in probe.reasons["extra.weight"]
    norms = probe.per_parameter()
    for name in ("a.weight", "a.bias"):
        p = dict(model.named_parameters())[name]
        out = model(x)
        expected = torch.stack([torch.autograd.grad(F.cross_entropy(out[j:j + 1], y[j:j + 1]), p, retain_graph=True)[0]
                                .pow(2).sum() for j in range(len(x))])
        torch.testing.assert_close(norms[name], expected, rtol=1e-4, atol=1e-10)
