"""An ``nn.Embedding`` subclass with a forward of its own that takes token ids but looks up positions (Whisper's
learned positional embedding) is left out by the probe's verification, without the handler ever indexing outside the
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
    assert "hooks did not see" in probe.reasons["pos.weight"]  # the verification's reason, not a handler failure
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
