"""Layers that see the batch folded with the positions (``[B * T, d]``: a model that flattens its tokens before its
MLP, as Hugging Face OPT does): covered when the rows are example-major, exact against torch.func and against the
gradients of each example's own loss from the same forward (dropout on); left out, with the reason, when the rows are
position-major or do not follow their examples (tokens sorted across the batch)."""

from __future__ import annotations

import json
import math
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from test_per_example import ce_seq, check, probe_run
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientNoiseScaleMonitor
from lightning_monitor.probes.per_example import PerExampleGradNorms

V, D = 11, 8


class Folded(nn.Module):
    """Tokens -> embedding -> rows flattened ``layout``-wise -> LayerNorm -> MLP -> logits ``[B, T, V]``."""

    def __init__(self, layout: str = "example", p: float = 0.0) -> None:
        super().__init__()
        self.layout = layout
        self.emb = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 16), nn.Linear(16, D)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(D, V)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        b, t, d = h.shape
        if self.layout == "example":
            rows = h.reshape(b * t, d)
        elif self.layout == "position":
            rows = h.transpose(0, 1).reshape(t * b, d)
        else:  # sorted across the batch by a score of each token: rows no longer follow their examples
            flat = h.reshape(b * t, d)
            order = flat.detach().sum(1).argsort()
            rows = flat[order]
        out = self.fc2(self.drop(F.gelu(self.fc1(self.norm(rows)))))
        if self.layout == "example":
            out = out.reshape(b, t, d)
        elif self.layout == "position":
            out = out.reshape(t, b, d).transpose(0, 1)
        else:
            out = torch.empty_like(out).index_copy(0, order, out).reshape(b, t, d)
        return self.head(h + out)


FOLDED = {f"{m}.{p}" for m in ("norm", "fc1", "fc2") for p in ("weight", "bias")}


@pytest.mark.parametrize("batch", [2, 3, 8])
def test_example_major_fold_covered_and_exact(batch: int) -> None:
    torch.manual_seed(0)
    model = Folded("example")
    x, y = torch.randint(0, V, (batch, 5)), torch.randint(0, V, (batch, 5))
    probe = check(model, ce_seq, x, y)
    assert probe.uncovered == []
    assert FOLDED <= set(probe.covered)


def test_example_major_fold_exact_with_dropout_in_training() -> None:
    """The layout is checked in eval mode (dropout would make the two reordered runs differ); the norms are those of
    the training forward's own masks: each example's loss differentiated on its own from the same forward."""
    torch.manual_seed(0)
    model = Folded("example", p=0.3).train()
    x, y = torch.randint(0, V, (6, 5)), torch.randint(0, V, (6, 5))
    torch.manual_seed(1)
    probe = probe_run(model, ce_seq, x, y)
    assert probe.uncovered == []
    torch.manual_seed(1)  # the same dropout masks
    losses = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").reshape(6, 5).mean(1)
    params = dict(model.named_parameters())
    per = probe.per_parameter()
    for i in range(6):
        grads = torch.autograd.grad(losses[i], list(params.values()), retain_graph=True, allow_unused=True)
        for (name, _), g in zip(params.items(), grads):
            want = 0.0 if g is None else float(g.double().pow(2).sum())
            assert float(per[name][i]) == pytest.approx(want, rel=1e-4, abs=1e-10), (name, i)


@pytest.mark.parametrize("layout", ["position", "sorted"])
def test_rows_that_do_not_follow_their_examples_are_left_out(layout: str) -> None:
    torch.manual_seed(0)
    model = Folded(layout)
    x, y = torch.randint(0, V, (4, 5)), torch.randint(0, V, (4, 5))
    probe = check(model, ce_seq, x, y)  # what is covered is exact
    assert set(probe.uncovered) == FOLDED
    assert all("could not be shown to follow their examples" in probe.reasons[n] for n in FOLDED)


class _MaskedRows(nn.Module):
    """The tokens of each example up to its length, selected with a mask (``h[mask]``) before the MLP: as many rows as
    ``B * per`` on average, not ``per`` for each example."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.head(torch.tanh(self.fc(self.emb(ids)[mask])))
        out = h.new_zeros(*ids.shape, V)
        out[mask] = h
        return out


@pytest.mark.parametrize("lengths", [[4, 4, 2, 6], [3, 5, 4, 4]])
def test_rows_selected_with_a_mask_are_left_out_when_uneven(lengths) -> None:
    """Lengths [4, 4, 2, 6]: the first two examples hold the average, so the 2-example run and a roll of the examples
    by one both looked like a fold of 4 rows an example, and examples 2 and 3 were given each other's rows (fc's norms
    1.106 and 0.064 against 1.009 and 0.092). Reversing the examples too shows the rows do not follow them."""
    torch.manual_seed(0)
    model = _MaskedRows()
    ids, y = torch.randint(0, V, (4, 6)), torch.randint(0, V, (4, 6))
    mask = torch.arange(6)[None] < torch.tensor(lengths)[:, None]
    with PerExampleGradNorms(model, loss_reduction="mean") as probe:
        ce = F.cross_entropy(model(ids, mask).reshape(-1, V), y.reshape(-1), reduction="none").reshape(4, 6)
        ((ce * mask).sum(1) / mask.sum(1)).mean().backward()
    assert probe.covered == ["emb.weight"]
    assert all("could not be shown to follow their examples" in probe.reasons[n]
               for n in ("fc.weight", "fc.bias", "head.weight", "head.bias"))
    # the embedding's norms are each example's own (a loop over single examples)
    per = probe.per_parameter()["emb.weight"]
    for i in range(4):
        model.zero_grad()
        m = mask[i:i + 1]
        ce = F.cross_entropy(model(ids[i:i + 1], m).reshape(-1, V), y[i].reshape(-1), reduction="none")
        (ce.reshape(1, 6) * m).sum().div(m.sum()).backward()
        assert float(per[i]) == pytest.approx(float(model.emb.weight.grad.pow(2).sum()), rel=1e-5)


def test_rows_routed_by_coincidence_as_many_as_the_examples_are_left_out() -> None:
    """An expert given the tokens routed to it (here the tokens of ids 0 and 1): 4 of them in a batch of 4 (two in the
    first example, none in the second, one in each other), 2 on the 2-example slice, so dimension 0 of its input
    scaled like a batch (Switch Transformers' experts were taken so, their norms silently wrong). The rows do not
    follow the examples when they are reordered: left out, with the reason; the rest exact."""

    class Routed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.expert, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
            self.pos = nn.Parameter(torch.randn(5, D))

        def forward(self, ids: Tensor) -> Tensor:
            flat = (self.emb(ids) + self.pos).reshape(-1, D)
            take = (ids.reshape(-1) < 2).nonzero().squeeze(1)
            out = flat.index_add(0, take, self.expert(flat[take]))
            return self.head(out.reshape(*ids.shape, D))

    torch.manual_seed(0)
    model = Routed()
    ids, y = torch.randint(2, V, (4, 5)), torch.randint(0, V, (4, 5))
    ids[0, 0] = ids[3, 0] = 0
    ids[0, 1] = ids[2, 0] = 1
    probe = probe_run(model, ce_seq, ids, y)
    assert set(probe.uncovered) == {"expert.weight", "expert.bias", "pos"}  # pos: used outside a module
    assert "rows do not follow the examples" in probe.reasons["expert.weight"]
    per = probe.per_parameter()
    for i in range(4):  # the covered parameters: each example's own loss, alone
        model.zero_grad()
        ce_seq(model(ids[i:i + 1]), y[i:i + 1]).backward()
        for name in probe.covered:
            want = float(dict(model.named_parameters())[name].grad.pow(2).sum())
            assert float(per[name][i]) == pytest.approx(want, rel=1e-4, abs=1e-12), (name, i)


def test_a_handler_of_one_batch_dimension_is_not_unfolded() -> None:
    """A convolution over ``[B * T, C, L]`` (frames folded with the batch) keeps its reason: its handler takes one
    batch dimension, so the fold is not unfolded into it."""

    class Frames(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(2, 3, 3)
            self.head = nn.Linear(3, V)

        def forward(self, x: Tensor) -> Tensor:  # x: [B, T, 2, L]
            b, t = x.shape[:2]
            z = self.conv(x.reshape(b * t, *x.shape[2:])).mean(-1)
            return self.head(z.reshape(b, t, -1))

    torch.manual_seed(0)
    x, y = torch.randn(4, 5, 2, 7), torch.randint(0, V, (4, 5))
    probe = check(Frames(), ce_seq, x, y)
    assert set(probe.uncovered) == {"conv.weight", "conv.bias"}
    assert "takes one batch dimension" in probe.reasons["conv.weight"]


class _FoldedLM(pl.LightningModule):
    """The folded model in `Trainer.fit`; the training step calls it (under DDP: inside the module's own call, where
    the layout check runs `training_step` on the reordered batch in eval mode)."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        torch.manual_seed(0)
        self.net = Folded("example", p=0.1)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, V, (256, 5), generator=g)

    def training_step(self, batch, batch_idx):
        (i,) = batch
        x = self.x[i]
        return ce_seq(self.net(x), (x + 1) % V)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(256)), batch_size=8)

    def on_train_end(self) -> None:
        mon = next(c for c in self.trainer.callbacks if isinstance(c, GradientNoiseScaleMonitor))
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as fh:
            json.dump({"count": mon.ema.count, "g2": float(mon.ema.g2.value), "tr": float(mon.ema.trace_sigma.value),
                       "uncovered": mon._probe.uncovered, "training": self.net.training}, fh)


def test_folded_layers_covered_under_ddp(tmp_path) -> None:
    from conftest import fit_ddp_spawn

    mon = GradientNoiseScaleMonitor(method="per_example", every_n_steps=2)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=6, callbacks=[mon],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    fit_ddp_spawn(trainer, _FoldedLM(str(tmp_path)))
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    assert r0["uncovered"] == r1["uncovered"] == []  # the folded MLP too, on both ranks
    assert r0["count"] == r1["count"] == 3
    assert all(r["tr"] > 0 and math.isfinite(r["g2"]) for r in (r0, r1))  # estimated (each rank its own examples)
    assert r0["training"] and r1["training"]  # the eval-mode runs left the modules' modes as they were
