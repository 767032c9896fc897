"""An ``nn.Embedding`` subclass with a forward of its own that takes token ids but looks up positions (Whisper's
learned positional embedding, which slices its rows) is left out (its forward, run under the probe, made no lookup in
its table), without the handler ever indexing outside the
table with the token ids (on CPU an ``IndexError`` the probe caught; on CUDA a device-side assert, which ends the
process); the rest of the model stays exact against a loop over examples."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_monitor import PerExampleGradNorms
from lightning_monitor.probes.per_example import embedding as emb_module

VOCAB, POSITIONS, D, T = 50, 16, 12, 10


class PositionsFromIds(nn.Embedding):
    """Takes ``input_ids`` like a token embedding, returns each token's position's row (``[B, T, D]``, as
    Whisper's decoder positions with ``position_ids``)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        b, t = input_ids.shape
        return self.weight[torch.arange(t, device=input_ids.device).expand(b, t)]


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = PositionsFromIds(POSITIONS, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.tok(ids) + self.pos(ids))))


def test_positions_looked_up_from_token_ids_are_left_out_without_indexing_outside(monkeypatch) -> None:
    seen_max: list[int] = []
    rows = emb_module._rows

    def spy(m, idx, g):
        seen_max.append(int(idx.max()))
        return rows(m, idx, g)

    monkeypatch.setattr(emb_module, "_rows", spy)
    torch.manual_seed(0)
    model = Decoder()
    ids = torch.randint(POSITIONS, VOCAB, (6, T))  # every token id lies outside the position table
    y = torch.randint(0, VOCAB, (6, T))
    with PerExampleGradNorms(model) as probe:
        F.cross_entropy(model(ids).reshape(-1, VOCAB), y.reshape(-1)).backward()
    per = probe.per_parameter()
    assert probe.uncovered == ["pos.weight"]
    # its forward ran under the probe and made no lookup in its table: said so, not a handler failure
    assert "reads its table without a lookup" in probe.reasons["pos.weight"]
    assert seen_max and max(seen_max) < VOCAB  # the token embedding's own ids, in its table
    pos_calls = [m for m in seen_max if m >= POSITIONS]
    assert len(pos_calls) <= 1  # only the token embedding's ids reach past the position table's size
    for i in range(6):
        model.zero_grad()
        F.cross_entropy(model(ids[i:i + 1]).reshape(-1, VOCAB), y[i]).backward()
        for name, p in model.named_parameters():
            if name != "pos.weight":
                # the probe rescales the batch mean's per-example parts to each example's own loss
                torch.testing.assert_close(per[name][i], p.grad.pow(2).sum(), rtol=1e-4, atol=1e-9)


class WithUnusedPooler(nn.Module):
    """A pooler the classifier does not use (BigBird's, under a classifier on the first token's hidden state)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.pooler = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        self.pooler(h.detach())  # computed, unused by the loss
        return self.head(h)


def test_a_covered_parameter_that_gets_no_gradient_has_zero_norms() -> None:
    # `covered` named the pooler's parameters, but `per_parameter()` left them out: every covered name has a row of
    # per-example norms, zero for a parameter no gradient reaches
    torch.manual_seed(0)
    model = WithUnusedPooler()
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    with PerExampleGradNorms(model) as probe:
        F.cross_entropy(model(x), y).backward()
    per = probe.per_parameter()
    assert set(per) == set(probe.covered) == {n for n, _ in model.named_parameters()}
    assert torch.equal(per["pooler.weight"], torch.zeros(5)) and torch.equal(per["pooler.bias"], torch.zeros(5))
    for i in range(5):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for name, p in model.named_parameters():
            want = torch.zeros(()) if p.grad is None else p.grad.pow(2).sum()
            torch.testing.assert_close(per[name][i], want, rtol=1e-4, atol=1e-9)
