"""GradientEarlyStopping(cut_frozen_prefix=True): once the leading blocks have all their matrices frozen and
nothing in front of them trains, the backward stops at their end; trainable gradients are unchanged."""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_monitor import GradientEarlyStopping, read_alerts
from lightning_monitor.functional.grades import block_container, find_components, frozen_prefix

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, GPTModule, make_loader  # noqa: E402
from conftest import fit_ddp_spawn  # noqa: E402

CFG = GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=32)
BLOCK0 = ["model.blocks.0.attn.*_proj", "model.blocks.0.mlp.*_proj"]
NORMS0 = [f"model.blocks.0.{ln}.{p}" for ln in ("ln_1", "ln_2") for p in ("weight", "bias")]


class FrozenEmbeddings(GPTModule):
    """The example GPT with its token and position embeddings frozen by the user."""

    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg, lr=3e-3)
        self.model.tok_emb.weight.requires_grad_(False)
        self.model.pos_emb.weight.requires_grad_(False)


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _module(cls: type = FrozenEmbeddings, seed: int = 0) -> GPTModule:
    pl.seed_everything(seed)
    return cls() if cls is FrozenEmbeddings else cls(CFG, lr=3e-3)


def _loader() -> Any:
    return make_loader("arith", block_size=32, batch_size=8, n_samples=256)


def _trainer(tmp_path: Path, callbacks: list, max_steps: int, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=CSVLogger(tmp_path), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks, default_root_dir=tmp_path, **kw,
    )


def _alerts(trainer: pl.Trainer) -> list[Any]:
    return [a for a in read_alerts(os.path.join(trainer.logger.log_dir, "alerts.jsonl")) if a.monitor == "grades"]


def _grads_and_block0_backward(module: GPTModule, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[dict, int, bool]:
    """One backward: the gradients, how often a gradient reached block 0's output, whether it required one."""
    calls = []
    seen = {}

    def on_output(block: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen["requires_grad"] = output.requires_grad
        if output.requires_grad:
            output.register_hook(lambda g: calls.append(1))

    handle = module.model.blocks[0].register_forward_hook(on_output)
    module.zero_grad(set_to_none=True)
    x, y = batch
    logits = module(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    handle.remove()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return grads, len(calls), seen["requires_grad"]


# ----------------------------------------------------------------------------- (a) the cut, against an oracle


def test_cut_stops_the_backward_and_keeps_trainable_gradients(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, reference_at="early", include=BLOCK0, every_n_steps=1, grace_steps=2, stop=False,
                               cut_frozen_prefix=True)
    module = _module()
    trainer = _trainer(tmp_path, [cb], max_steps=5)
    trainer.fit(module, _loader())
    assert set(cb.frozen) == {n for n in cb.components} and set(cb.frozen.values()) == {2}
    assert cb.cut == {n: 2 for n in NORMS0} and cb.cut_depth == 1
    params = dict(module.named_parameters())
    assert not any(params[n].requires_grad for n in NORMS0)
    assert params["model.blocks.1.ln_1.weight"].requires_grad and params["model.blocks.1.attn.q_proj.weight"].requires_grad
    cut_alerts = [a for a in _alerts(trainer) if a.kind == "prefix_cut"]
    assert len(cut_alerts) == 1 and cut_alerts[0].step == 2 and cut_alerts[0].value == 1.0
    assert not [a for a in _alerts(trainer) if a.kind.startswith("prefix_") and a.kind != "prefix_cut"]

    # oracle: the same weights without the cut (block 0's norms still trainable)
    uncut = copy.deepcopy(module)
    for n, p in uncut.named_parameters():
        if n in NORMS0:
            p.requires_grad_(True)
    batch = next(iter(_loader()))
    got, calls_cut, reaches_cut = _grads_and_block0_backward(module, batch)
    want, calls_uncut, reaches_uncut = _grads_and_block0_backward(uncut, batch)
    assert (calls_cut, reaches_cut) == (0, False)  # the autograd graph does not reach block 0
    assert (calls_uncut, reaches_uncut) == (1, True)
    assert set(want) - set(got) == set(NORMS0)  # only the explicitly cut parameters lose their gradient
    assert set(got) == {n for n, p in module.named_parameters() if p.requires_grad}
    for name, g in got.items():
        assert torch.allclose(g, want[name], rtol=1e-5, atol=1e-7), name


def test_frozen_prefix_counts_leading_blocks_only() -> None:
    model = GPT(CFG)
    comps = find_components(model)
    assert block_container(model, comps) == "blocks"
    for n in ("tok_emb", "pos_emb"):
        getattr(model, n).weight.requires_grad_(False)
    for c in comps.values():  # the second block's matrices only: no leading block is frozen
        if c.name.startswith("blocks.1."):
            for p in c.params:
                p.requires_grad_(False)
    cut = frozen_prefix(model, "blocks")
    assert cut.depth == 0 and cut.params == {} and cut.front == ()
    for c in comps.values():
        for p in c.params:
            p.requires_grad_(False)
    cut = frozen_prefix(model, "blocks")
    assert cut.depth == 2 and len(cut.params) == 8 and cut.front == ()


def test_hf_block_containers() -> None:
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=31, n_positions=8, n_embd=16, n_layer=2, n_head=2))
    assert block_container(gpt2, find_components(gpt2)) == "transformer.h"
    # the head is tied to the token embedding, which trains: in front of the blocks, so nothing is cut
    for c in find_components(gpt2).values():
        for p in c.params:
            p.requires_grad_(False)
    cut = frozen_prefix(gpt2, "transformer.h")
    assert cut.depth == 2 and cut.front == ("transformer.wte.weight", "transformer.wpe.weight")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=31, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16))
    assert block_container(llama, find_components(llama)) == "model.layers"


# ----------------------------------------------------------------------------- (b) a real fit, resumed


def test_fit_cuts_and_resume_restores_the_cut(tmp_path: Path) -> None:
    losses = LossRecorder()
    cb = GradientEarlyStopping(tau=1e6, reference_at="early", every_n_steps=2, grace_steps=4, stop=False, cut_frozen_prefix=True)
    module = _module()
    trainer = _trainer(tmp_path, [cb, losses], max_steps=10)
    trainer.fit(module, _loader())
    assert len(cb.frozen) == 12 and set(cb.frozen.values()) == {4}
    norms = [f"model.blocks.{i}.{ln}.{p}" for i in range(2) for ln in ("ln_1", "ln_2") for p in ("weight", "bias")]
    assert cb.cut == {n: 4 for n in norms} and cb.cut_depth == 2
    assert trainer.global_step == 10 and all(math.isfinite(x) for x in losses.losses)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable == {"model.ln_f.weight", "model.ln_f.bias", "model.lm_head.weight"}
    opt = trainer.optimizers[0]
    params = dict(module.named_parameters())
    assert all(params[n] not in opt.state and params[n].grad is None for n in norms)
    state = cb.state_dict()
    assert state["cut"] == cb.cut and state["cut_depth"] == 2

    ckpt = str(tmp_path / "cut.ckpt")
    trainer.save_checkpoint(ckpt)
    saved = {n: p.detach().clone() for n, p in module.named_parameters()}

    class FrozenAtStart(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            self.frozen = {n for n, p in pl_module.named_parameters() if not p.requires_grad}

    probe = FrozenAtStart()
    cb2 = GradientEarlyStopping(tau=1e6, reference_at="early", every_n_steps=2, grace_steps=4, stop=False, cut_frozen_prefix=True)
    module2 = _module(seed=1)
    losses2 = LossRecorder()
    _trainer(tmp_path / "resumed", [cb2, probe, losses2], max_steps=14).fit(module2, _loader(), ckpt_path=ckpt)
    assert probe.frozen == set(params) - trainable
    assert cb2.cut == cb.cut and cb2.cut_depth == 2 and cb2.frozen == cb.frozen
    assert all(math.isfinite(x) for x in losses2.losses) and len(losses2.losses) == 4
    after = dict(module2.named_parameters())
    for n in norms:
        torch.testing.assert_close(after[n].detach(), saved[n], rtol=0, atol=0)
    assert not torch.equal(after["model.lm_head.weight"].detach(), saved["model.lm_head.weight"])


# ----------------------------------------------------------------------------- (c) nothing cut


def test_trainable_embeddings_keep_the_blocks_in_the_backward(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, reference_at="early", every_n_steps=2, grace_steps=4, stop=False, cut_frozen_prefix=True)
    module = _module(GPTModule)
    trainer = _trainer(tmp_path, [cb], max_steps=10)
    trainer.fit(module, _loader())
    assert len(cb.frozen) == 12 and cb.cut == {} and cb.cut_depth == 0
    assert all(p.requires_grad for n, p in module.named_parameters() if ".ln_" in n)
    notes = [a for a in _alerts(trainer) if a.kind == "prefix_not_cut"]
    assert len(notes) == 1 and "model.tok_emb.weight" in notes[0].message


def test_option_off_cuts_nothing(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, reference_at="early", every_n_steps=2, grace_steps=4, stop=False)
    module = _module()
    trainer = _trainer(tmp_path, [cb], max_steps=6)
    trainer.fit(module, _loader())
    assert len(cb.frozen) == 12 and cb.cut == {}
    assert all(p.requires_grad for n, p in module.named_parameters() if ".ln_" in n)
    assert not [a for a in _alerts(trainer) if a.kind.startswith("prefix_")]


class TwoStacks(pl.LightningModule):
    """Components in two containers (an encoder and a decoder): the block order is unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(48, 16).requires_grad_(False)
        self.encoder = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2))
        self.decoder = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 48)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.emb(x)
        for b in [*self.encoder, *self.decoder]:
            h = h + torch.tanh(b(h))
        return F.cross_entropy(self.head(h).reshape(-1, 48), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_unknown_block_structure_is_said_once_and_nothing_cut(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, reference_at="early", every_n_steps=2, grace_steps=2, stop=False, cut_frozen_prefix=True)
    module = TwoStacks()
    trainer = _trainer(tmp_path, [cb], max_steps=6)
    trainer.fit(module, make_loader("arith", block_size=16, batch_size=4, n_samples=64))
    assert len(cb.frozen) == 4 and cb.cut == {}
    assert all(p.requires_grad for n, p in module.named_parameters() if n.endswith(".0.weight") and p.dim() == 1)
    notes = [a for a in _alerts(trainer) if a.kind.startswith("prefix_")]
    assert [a.kind for a in notes] == ["prefix_cut_unavailable"] and notes[0].severity == "info"


class EmbeddingAfterBlocks(TwoStacks):
    """The embedding is registered after the blocks but runs before them, and trains."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2))
        self.emb = nn.Embedding(48, 16)
        self.head = nn.Linear(16, 48)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.emb(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return F.cross_entropy(self.head(h).reshape(-1, 48), y.reshape(-1))


def test_a_cut_that_does_not_stop_the_backward_is_reported(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, reference_at="early", include="blocks.0.1", every_n_steps=2, grace_steps=2, stop=False,
                               cut_frozen_prefix=True)
    trainer = _trainer(tmp_path, [cb], max_steps=6)
    trainer.fit(EmbeddingAfterBlocks(), make_loader("arith", block_size=16, batch_size=4, n_samples=64))
    assert cb.cut_depth == 1 and set(cb.cut) == {"blocks.0.0.weight", "blocks.0.0.bias"}
    warned = [a for a in _alerts(trainer) if a.kind == "prefix_cut_ineffective"]
    assert len(warned) == 1 and warned[0].severity == "warning"


# ----------------------------------------------------------------------------- (d) bad input


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_option(value: Any) -> None:
    with pytest.raises(ValueError, match="`cut_frozen_prefix` must be True or False"):
        GradientEarlyStopping(cut_frozen_prefix=value)


def test_checkpoint_cut_of_another_model_is_refused(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, reference_at="early", every_n_steps=2, grace_steps=4, stop=False, cut_frozen_prefix=True)
    state = cb.state_dict()
    state.update(cut={"model.blocks.7.ln_1.weight": 4}, cut_depth=8)
    cb2 = GradientEarlyStopping(tau=1e6, reference_at="early", every_n_steps=2, grace_steps=4, stop=False, cut_frozen_prefix=True)
    cb2.load_state_dict(state)
    with pytest.raises(ValueError, match=r"frozen by the prefix cut of the checkpoint are not in this model"):
        _trainer(tmp_path, [cb2], max_steps=2).fit(_module(), _loader())


# ----------------------------------------------------------------------------- DDP (2 ranks, gloo)


class DDPProbe(FrozenEmbeddings):
    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_train_end(self) -> None:
        cb = next(c for c in self.trainer.callbacks if isinstance(c, GradientEarlyStopping))
        out = {
            "cut": cb.cut, "global_step": self.trainer.global_step,
            "requires_grad": {n: p.requires_grad for n, p in self.named_parameters()},
            "weights": {n: p.detach().double().sum().item() for n, p in self.named_parameters()},
        }
        with open(os.path.join(self.out_dir, f"rank{self.global_rank}.json"), "w", encoding="utf-8") as fh:
            json.dump(out, fh)


def test_ddp_two_ranks_cut_identically(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e6, reference_at="early", every_n_steps=2, grace_steps=4, stop=False, cut_frozen_prefix=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn_find_unused_parameters_true", max_steps=8,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[cb], default_root_dir=tmp_path,
    )
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        pl.seed_everything(0)
        fit_ddp_spawn(trainer, DDPProbe(str(tmp_path)), make_loader("arith", block_size=32, batch_size=4, n_samples=128))
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["cut"] == r1["cut"] and len(r0["cut"]) == 8 and set(r0["cut"].values()) == {4}
    assert r0["global_step"] == r1["global_step"] == 8  # training went on after the cut, no DDP error
    assert r0["requires_grad"] == r1["requires_grad"] and not r0["requires_grad"]["model.blocks.0.ln_1.weight"]
    assert r0["weights"] == pytest.approx(r1["weights"], rel=1e-6)
