"""GradES functional layer against independent oracles (numpy, explicit autograd runs)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lightning_monitor.functional import (
    ema_update,
    find_components,
    freeze_mask,
    freeze_parameters,
    mean_abs,
    mean_abs_update,
    relative_ratio,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


# ----------------------------------------------------------------------------- discovery


def test_example_gpt_components_are_its_projections() -> None:
    model = GPT(GPTConfig(n_layer=2, d_model=16, n_head=2))
    found = find_components(model)
    expected = [f"blocks.{i}.{p}" for i in range(2) for p in
                ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj")]
    assert list(found) == expected
    for name, comp in found.items():
        module = model.get_submodule(name)
        assert comp.weight is module.weight
        assert {id(p) for p in comp.params} == {id(module.weight), id(module.bias)}


class Conv1D(nn.Module):
    """GPT-2's transposed linear layer (not an nn.Linear)."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


def _gpt2_like() -> nn.Module:
    def block() -> nn.Module:
        attn = nn.ModuleDict({"c_attn": Conv1D(8, 24), "c_proj": Conv1D(8, 8)})
        mlp = nn.ModuleDict({"c_fc": Conv1D(8, 32), "c_proj": Conv1D(32, 8)})
        return nn.ModuleDict({"ln_1": nn.LayerNorm(8), "attn": attn, "ln_2": nn.LayerNorm(8), "mlp": mlp})

    h = nn.ModuleList(block() for _ in range(2))
    transformer = nn.ModuleDict({"wte": nn.Embedding(10, 8), "wpe": nn.Embedding(4, 8), "h": h, "ln_f": nn.LayerNorm(8)})
    return nn.ModuleDict({"transformer": transformer, "lm_head": nn.Linear(8, 10)})


def test_gpt2_naming_scheme_with_conv1d() -> None:
    found = find_components(_gpt2_like())
    assert list(found) == [f"transformer.h.{i}.{p}" for i in range(2)
                           for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def test_plain_linear_children_of_blocks() -> None:
    layers = nn.ModuleList(
        nn.ModuleDict({"norm": nn.LayerNorm(4), "qkv": nn.Linear(4, 12), "fc1": nn.Linear(4, 8), "fc2": nn.Linear(8, 4)})
        for _ in range(3)
    )
    model = nn.ModuleDict({"embed": nn.Embedding(5, 4), "layers": layers, "head": nn.Linear(4, 5)})
    found = find_components(model)
    assert list(found) == [f"layers.{i}.{p}" for i in range(3) for p in ("qkv", "fc1", "fc2")]


class LoraLinear(nn.Module):
    """PEFT-style wrapper: frozen base layer, adapters in ModuleDicts keyed by adapter name."""

    def __init__(self, d: int, r: int = 2) -> None:
        super().__init__()
        self.base_layer = nn.Linear(d, d)
        self.base_layer.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(d, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, d, bias=False)})


class ParamLora(nn.Module):
    """Minimal LoRA holding the adapters as bare parameters."""

    def __init__(self, d: int, r: int = 2) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d), requires_grad=False)
        self.lora_A = nn.Parameter(torch.randn(r, d))
        self.lora_B = nn.Parameter(torch.zeros(d, r))


def test_lora_adapters_are_components_not_frozen_base() -> None:
    layers = nn.ModuleList(nn.ModuleDict({"q_proj": LoraLinear(4), "v_proj": ParamLora(4)}) for _ in range(2))
    found = find_components(nn.ModuleDict({"layers": layers}))
    assert list(found) == [n for i in range(2) for n in (
        f"layers.{i}.q_proj.lora_A.default", f"layers.{i}.q_proj.lora_B.default",
        f"layers.{i}.v_proj.lora_A", f"layers.{i}.v_proj.lora_B")]
    comp = found["layers.0.v_proj.lora_B"]
    assert comp.weight is layers[0]["v_proj"].lora_B and comp.params == (comp.weight,)


def test_explicit_patterns_can_ask_for_embeddings_and_head() -> None:
    model = GPT(GPTConfig(n_layer=1, d_model=16, n_head=2))
    found = find_components(model, include=["tok_emb", "lm_head", "blocks.*.attn.q_proj"], exclude="blocks.0.attn.q_proj")
    assert list(found) == ["tok_emb", "lm_head"]
    with pytest.raises(ValueError, match=r"`exclude` pattern 'nope\*' matches no module.*Module names are"):
        find_components(model, exclude="nope*")
    with pytest.raises(ValueError, match="without a `weight`"):
        find_components(model, include=["blocks.0.attn"])


def test_no_component_found_lists_module_names() -> None:
    model = nn.ModuleDict({"emb": nn.Embedding(5, 4), "norm": nn.LayerNorm(4), "head": nn.Linear(4, 5)})
    with pytest.raises(ValueError, match=r"no trainable component.*`include=\[\.\.\.\]`.*'emb', 'norm', 'head'"):
        find_components(model)


# ----------------------------------------------------------------------------- statistics


def test_mean_abs_matches_numpy() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g) * 10, torch.randn(2, 3, 4, generator=g)]
    expected = [np.abs(t.numpy()).mean() for t in tensors]
    np.testing.assert_allclose(mean_abs(tensors).numpy(), expected, rtol=1e-6)
    assert mean_abs([torch.ones(2, dtype=torch.float64)]).dtype == torch.float32


def test_mean_abs_update_matches_numpy() -> None:
    g = torch.Generator().manual_seed(1)
    cur = [torch.randn(6, 4, generator=g), torch.randn(4, 4, generator=g)]
    prev = [c + 0.1 * torch.randn(c.shape, generator=g) for c in cur]
    expected = [np.abs(c.numpy() - p.numpy()).mean() / 5 for c, p in zip(cur, prev)]
    np.testing.assert_allclose(mean_abs_update(cur, prev, steps=5).numpy(), expected, rtol=1e-5)
    with pytest.raises(ValueError, match="steps"):
        mean_abs_update(cur, prev, steps=0)


def test_relative_rule_and_ema() -> None:
    stat = torch.tensor([0.1, 0.6, 0.0, 2.0, float("nan"), 0.3])
    ref = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.5])
    ratio = relative_ratio(stat, ref)
    assert ratio.tolist()[:4] == pytest.approx([0.1, 0.6, 0.0, float("inf")])
    assert freeze_mask(stat, ref, tau=0.5).tolist() == [True, False, True, False, False, False]
    assert freeze_mask(stat, None, tau=0.5).tolist() == [True, False, True, False, False, True]
    # a reference not taken yet (NaN): no ratio, no freeze, even for a zero statistic
    pending = torch.tensor([float("nan"), float("nan")])
    assert relative_ratio(torch.tensor([0.0, 1.0]), pending).isnan().all()
    assert freeze_mask(torch.tensor([0.0, 1.0]), pending, tau=0.5).tolist() == [False, False]
    prev, new = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0])
    assert ema_update(prev, new, 0.25).tolist() == pytest.approx([0.25 * 1 + 0.75 * 3, 0.25 * 2])
    assert ema_update(None, new, 0.9) is new


# ----------------------------------------------------------------------------- freezing


def test_freeze_parameters_frees_state_and_keeps_other_weights_training() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    frozen = list(model[2].parameters())
    assert all(p in opt.state for p in frozen)
    reference = copy.deepcopy(model)  # oracle: same weights, nothing frozen

    assert freeze_parameters(frozen, [opt]) == 8 * 8 + 8
    assert all(not p.requires_grad and p.grad is None and p not in opt.state for p in frozen)
    before = [p.detach().clone() for p in model.parameters()]

    opt.zero_grad()
    reference.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    assert all(p.grad is None for p in frozen)
    # gradients still flow through the frozen layer to earlier layers, exactly as without freezing
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)
    opt.step()
    after = list(model.parameters())
    for p, b in zip(after, before):
        if any(p is f for f in frozen):
            assert torch.equal(p, b)  # no update, no weight decay
        else:
            assert not torch.equal(p, b)
    # the optimizer's state_dict keeps its layout and loads into a fresh optimizer
    fresh = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=0.1)
    fresh.load_state_dict(opt.state_dict())


def test_mean_abs_of_low_precision_gradients_is_accumulated_in_float32() -> None:
    # a bf16 model (precision="bf16-true"): the sum of |g| was taken in bf16, up to 0.4% off
    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(256, 512, generator=g) * 1e-3).bfloat16(), torch.randn(64, generator=g).double(),
               torch.randn(30, 3, generator=g).half()]
    oracle = np.array([np.abs(t.double().numpy()).mean() for t in tensors])
    got = mean_abs(tensors)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.double().numpy(), oracle, rtol=1e-5)
