"""``nn.MultiheadAttention`` in the per-example probe (its packed input projection and its ``out_proj``) against
torch.func, the plain forward's outputs and gradients bit for bit, what stays uncovered and why, GradES's
components, and the noise scale of an ``nn.TransformerEncoder`` in ``Trainer.fit`` against the loop oracle."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from test_per_example import ce_seq, check
from test_probe_fixes_oracle import NoiseScaleOracle
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientEarlyStopping, GradientNoiseScaleMonitor, PerExampleGradNorms
from lightning_monitor.functional.grades import find_components

CROSS = "cross-attention"


class Attend(nn.Module):
    """Linear -> MultiheadAttention (called directly, with the options given) -> Linear."""

    def __init__(self, batch_first: bool = True, bias: bool = True, need_weights: bool = False,
                 masks: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=batch_first, bias=bias)
        self.out = nn.Linear(8, 3)
        self.batch_first, self.need_weights, self.masks = batch_first, need_weights, masks

    def forward(self, x: Tensor) -> Tensor:  # x: [B, T, 5]
        h = self.inp(x if self.batch_first else x.transpose(0, 1))
        t = x.shape[1]
        kw: dict[str, Any] = {}
        if self.masks:
            kw["attn_mask"] = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
            # padding read off each example's own data (the first key never: every query keeps one)
            kw["key_padding_mask"] = (x[..., 0] > 0.8) & (torch.arange(t) > 0)
        a, w = self.mha(h, h, h, need_weights=self.need_weights, **kw)
        if self.need_weights:
            assert w is not None
        out = self.out(a)
        return out if self.batch_first else out.transpose(0, 1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("masks", [False, True])
def test_self_attention_exact(batch_first: bool, need_weights: bool, masks: bool) -> None:
    torch.manual_seed(0)
    model = Attend(batch_first, need_weights=need_weights, masks=masks)
    x, y = torch.randn(4, 6, 5), torch.randint(0, 3, (4, 6))
    probe = check(model, ce_seq, x, y)
    assert probe.uncovered == []
    assert {"mha.in_proj_weight", "mha.in_proj_bias", "mha.out_proj.weight", "mha.out_proj.bias"} <= set(probe.covered)


@pytest.mark.parametrize("strategy", ["auto", "gram", "materialize"])
def test_self_attention_without_bias_exact(strategy: str) -> None:
    torch.manual_seed(1)
    model = Attend(bias=False)
    probe = check(model, ce_seq, torch.randn(3, 5, 5), torch.randint(0, 3, (3, 5)), linear_strategy=strategy)
    assert probe.uncovered == []
    assert "mha.in_proj_weight" in probe.covered and "mha.in_proj_bias" not in probe.covered


def _encoder(dropout: float = 0.0) -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=dropout, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(16, 3))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_the_probe_leaves_outputs_and_gradients_bit_for_bit(dropout: float) -> None:
    """The patched forward runs the module's own operations: the loss and every gradient are those of the plain
    forward (with dropout, from the same random state: the probe draws nothing)."""
    torch.manual_seed(0)
    model = _encoder(dropout)
    x = torch.randn(5, 7, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(7)

    def run(probed: bool) -> tuple[Tensor, dict[str, Tensor]]:
        model.zero_grad()
        torch.manual_seed(3)
        if probed:
            with PerExampleGradNorms(model, linear_strategy="gram") as probe:
                loss = model[1](model[0](x, mask=mask, is_causal=True)).pow(2).mean()
                loss.backward()
            assert probe.uncovered == []
        else:
            loss = model[1](model[0](x, mask=mask, is_causal=True)).pow(2).mean()
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_loss, plain = run(False)
    probed_loss, probed = run(True)
    assert torch.equal(plain_loss, probed_loss)
    assert [n for n in plain if not torch.equal(plain[n], probed[n])] == []
    assert torch.nn.functional.linear is torch._C._nn.linear  # put back after the calls


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.out(self.layer(h, h.flip(1)))


@pytest.mark.parametrize("fastpath", [True, False])
def test_encoder_layer_in_eval_mode_exact(fastpath: bool) -> None:
    """A model trained in eval mode (dropout off, a common fine-tuning setting): the probe's batch-size run, without
    gradients, must not take the fused fast path of ``nn.TransformerEncoderLayer`` (it calls no hooked projection;
    the attention was left out as "runs a different number of times on a smaller batch"). Exact, and the user's
    fast-path setting is left as it was."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), nn.Linear(8, 3)).eval()
        probe = check(model, ce_seq, torch.randn(4, 5, 8), torch.randint(0, 3, (4, 5)))
        assert probe.uncovered == []
        assert torch.backends.mha.get_fastpath_enabled() is fastpath
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def test_cross_attention_input_projection_is_left_out_with_the_reason() -> None:
    torch.manual_seed(0)
    model = Decoder()
    x, y = torch.randn(4, 6, 5), torch.randint(0, 3, (4, 6))
    probe = check(model, ce_seq, x, y)  # every covered parameter exact
    cross = {"layer.multihead_attn.in_proj_weight", "layer.multihead_attn.in_proj_bias"}
    assert set(probe.uncovered) == cross
    assert all(CROSS in probe.reasons[n] for n in cross)
    assert {"layer.self_attn.in_proj_weight", "layer.self_attn.out_proj.weight",
            "layer.multihead_attn.out_proj.weight"} <= set(probe.covered)


def test_frozen_input_projection_keeps_out_proj_covered() -> None:
    """GradES freezes the attention's input projection: its out_proj, still trained, stays covered."""
    torch.manual_seed(0)
    model = Attend()
    model.mha.in_proj_weight.requires_grad_(False)
    model.mha.in_proj_bias.requires_grad_(False)
    probe = check(model, ce_seq, torch.randn(4, 6, 5), torch.randint(0, 3, (4, 6)))
    assert probe.uncovered == []
    assert {"mha.out_proj.weight", "mha.out_proj.bias"} <= set(probe.covered)


def test_separate_projection_weights_are_left_out_with_the_reason() -> None:
    class KDim(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, kdim=4, vdim=4, batch_first=True)
            self.out = nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.out(self.mha(x, x[..., :4], x[..., 4:], need_weights=False)[0])

    torch.manual_seed(0)
    model = KDim()
    probe = check(model, ce_seq, torch.randn(4, 6, 8), torch.randint(0, 3, (4, 6)))
    mha = {f"mha.{n}" for n, _ in model.mha.named_parameters()}
    assert set(probe.uncovered) == mha
    assert "kdim" in probe.reasons["mha.q_proj_weight"]
    assert "uses its parameters without calling" in probe.reasons["mha.out_proj.weight"]


def test_grades_components_of_torch_attention() -> None:
    comps = find_components(_encoder())
    names = sorted(comps)
    assert names == sorted(f"0.layers.{i}.{m}" for i in (0, 1)
                           for m in ("self_attn", "self_attn.out_proj", "linear1", "linear2"))
    attn = comps["0.layers.0.self_attn"]
    mha = _encoder().eval()[0].layers[0].self_attn  # a fresh one: the shapes
    assert attn.weight.shape == mha.in_proj_weight.shape and len(attn.params) == 2


class _Step(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _encoder()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return ce_seq(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(callbacks: list[Any], steps: int, tmp_path: Any) -> pl.Trainer:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, 16, generator=g), torch.randint(0, 3, (64, 6), generator=g)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Step(), DataLoader(TensorDataset(x, y), batch_size=8))
    return trainer


def test_noise_scale_of_a_transformer_encoder_in_fit_exact(tmp_path) -> None:
    torch.manual_seed(0)
    mon = GradientNoiseScaleMonitor(method="per_example", every_n_steps=1, smoothing=0.0, per_layer=False)
    oracle = NoiseScaleOracle(mon, ce_seq, lambda m, xi: m(xi))
    trainer = _fit([oracle, mon], 4, tmp_path)
    assert mon._probe.uncovered == []
    assert float(trainer.callback_metrics["gns/coverage"]) == 1.0
    assert len(oracle.rows) == 4 and oracle.worst() < 1e-3


def test_noise_scale_after_grades_froze_the_attention(tmp_path) -> None:
    """GradES freezes every attention projection mid-run; the per-example norms go on over what still trains,
    exact, with out_proj still called through the patched attention."""
    torch.manual_seed(0)
    grades = GradientEarlyStopping(include=["net.0.layers.*.self_attn", "net.0.layers.*.self_attn.out_proj"],
                                   tau=1e9, grace_steps=2, every_n_steps=1, stop=False)
    mon = GradientNoiseScaleMonitor(method="per_example", every_n_steps=1, smoothing=0.0, per_layer=False)
    oracle = NoiseScaleOracle(mon, ce_seq, lambda m, xi: m(xi))
    trainer = _fit([grades, oracle, mon], 8, tmp_path)
    assert len(grades.frozen) == 4
    assert not any(p.requires_grad for n, p in trainer.lightning_module.named_parameters() if "self_attn" in n)
    assert mon._probe.uncovered == []
    assert float(trainer.callback_metrics["gns/coverage"]) == 1.0
    assert len(oracle.rows) == 8 and oracle.worst() < 1e-3


def test_the_interception_check_leaves_the_global_random_stream_alone(monkeypatch) -> None:
    # the check builds a throwaway nn.MultiheadAttention: its initialisation drew from the global generator, so a run
    # with the noise-scale monitor shuffled its data and drew its dropout masks differently from the same run without
    from lightning_monitor.probes.per_example import attention

    monkeypatch.setattr(attention, "_INTERCEPTS", None)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    assert attention.intercepts_linear() in (True, False)
    assert torch.equal(state, torch.get_rng_state())
