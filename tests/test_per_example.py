"""PerExampleGradNorms against per-sample gradients from torch.func (vmap over grad)."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from lightning_monitor import PerExampleGradNorms

TOL = 1e-4


# ----------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 16, bias=False)
        self.fc3 = nn.Linear(16, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.ln(self.fc1(x))))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, groups=2, bias=False)
        self.c3 = nn.Conv2d(8, 6, (3, 2), padding="same", padding_mode="reflect", dilation=(1, 2))
        self.c4 = nn.Conv2d(6, 4, 1)
        self.head = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        x = torch.relu(self.c3(x))
        x = self.c4(x)
        return self.head(x.flatten(1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, rms: bool) -> None:
        super().__init__()
        self.heads = heads
        self.n1 = nn.RMSNorm(d) if rms else nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.n2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.n1(x)

        def split(z: Tensor) -> Tensor:
            return z.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        att = torch.softmax(split(self.q(h)) @ split(self.k(h)).transpose(-1, -2) / (d // self.heads) ** 0.5, -1)
        x = x + self.o((att @ split(self.v(h))).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 11, d: int = 16, t: int = 7, tied: bool = False, broadcast_pos: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(t, d)
        self.blocks = nn.ModuleList([Block(d, 2, rms=False), Block(d, 2, rms=True)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.broadcast_pos = broadcast_pos
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos if self.broadcast_pos else pos.expand(idx.shape))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class TwiceUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))


class WithMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.out(self.mha(h, h, h, need_weights=False)[0])


def ce_seq(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------------------- oracle


def oracle(model: nn.Module, loss_fn, x: Tensor, y: Tensor, reduction: str = "mean") -> dict[str, Tensor]:
    """Per-example squared gradient norms per parameter name, from torch.func."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    # randomness="same": Hugging Face decoders of older transformers (OPT, BART, BioGPT in 4.40) draw `torch.rand([])`
    # for their layerdrop in training mode, which vmap refuses by default. The models checked here have layerdrop and
    # dropout 0, so no draw changes the result; a model whose draws did would not match the probe's own forward anyway
    grads = vmap(grad(loss_one), in_dims=(None, 0, 0), randomness="same")(params, x, y)
    scale = 1.0 if reduction == "mean" else 1.0
    return {k: (g.flatten(1).double().pow(2).sum(1) * scale) for k, g in grads.items()}


def probe_run(model: nn.Module, loss_fn, x: Tensor, y: Tensor, **kw) -> PerExampleGradNorms:
    model.zero_grad()
    with PerExampleGradNorms(model, **kw) as probe:
        loss = loss_fn(model(x), y)
        if kw.get("loss_reduction") == "sum":
            loss = loss * x.shape[0]
        loss.backward()
    return probe


def rel_err(a: Tensor, b: Tensor) -> float:
    return float(((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-30)).max())


def check(model: nn.Module, loss_fn, x: Tensor, y: Tensor, **kw) -> PerExampleGradNorms:
    probe = probe_run(model, loss_fn, x, y, **kw)
    ref = oracle(model, loss_fn, x, y)
    per = probe.per_parameter()
    assert set(per) == set(probe.covered)
    total = torch.stack([ref[n] for n in probe.covered]).sum(0)
    for name in probe.covered:
        # per parameter: relative to that parameter's norm, floored at 1e-8 of the example's total
        # (some gradients are zero in exact arithmetic, e.g. the bias of an attention key projection)
        err = (per[name].double() - ref[name]).abs() / torch.maximum(ref[name], 1e-8 * total)
        assert float(err.max()) <= TOL, name
    assert rel_err(probe.squared_norms(), total) <= TOL
    return probe


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("strategy", ["auto", "fused", "gram", "materialize"])
def test_mlp_exact(strategy: str) -> None:
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(9, 12), torch.randint(0, 5, (9,))
    probe = check(model, F.cross_entropy, x, y, linear_strategy=strategy)
    assert probe.uncovered == []
    assert len(probe.covered) == len(list(model.parameters()))


def test_mlp_sum_reduction() -> None:
    torch.manual_seed(1)
    model = MLP()
    x, y = torch.randn(6, 12), torch.randint(0, 5, (6,))
    probe = probe_run(model, F.cross_entropy, x, y, loss_reduction="sum")
    ref = oracle(model, F.cross_entropy, x, y)
    assert rel_err(probe.squared_norms(), torch.stack(list(ref.values())).sum(0)) <= TOL


def test_cnn_exact() -> None:
    torch.manual_seed(0)
    model = CNN()
    x, y = torch.randn(5, 3, 8, 8), torch.randint(0, 5, (5,))
    probe = check(model, F.cross_entropy, x, y)
    assert probe.uncovered == []


@pytest.mark.parametrize("strategy", ["auto", "gram", "materialize"])
def test_transformer_exact(strategy: str) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    x = torch.randint(0, 11, (4, 7))
    x[0, :3] = 0  # padding tokens
    x[1, :] = 5  # one token repeated
    y = torch.randint(0, 11, (4, 7))
    probe = check(model, ce_seq, x, y, linear_strategy=strategy)
    assert probe.uncovered == []


@pytest.mark.parametrize("strategy", ["auto", "gram"])
def test_tied_weights_exact(strategy: str) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(tied=True)
    x, y = torch.randint(0, 11, (3, 7)), torch.randint(0, 11, (3, 7))
    probe = check(model, ce_seq, x, y, linear_strategy=strategy)
    assert "tok.weight" in probe.covered


@pytest.mark.parametrize("seq", [False, True])
def test_module_used_twice_exact(seq: bool) -> None:
    torch.manual_seed(0)
    model = TwiceUsed()
    if seq:  # (B, T, d): the fused path for both uses
        x, y = torch.randn(5, 4, 6), torch.randint(0, 3, (5, 4))
        probe = check(model, ce_seq, x, y)
    else:
        x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
        probe = check(model, F.cross_entropy, x, y)
    assert set(probe.covered) == {n for n, _ in model.named_parameters()}


def test_multihead_attention_covered() -> None:
    """Its packed input projection and its out_proj (test_per_example_attention.py has the other cases)."""
    torch.manual_seed(0)
    model = WithMHA()
    x, y = torch.randn(4, 5, 5), torch.randint(0, 3, (4, 5))
    probe = check(model, ce_seq, x, y)
    assert probe.uncovered == []
    assert set(probe.covered) == {n for n, _ in model.named_parameters()}


def test_batch_size_one() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    x, y = torch.randint(0, 11, (1, 7)), torch.randint(0, 11, (1, 7))
    probe = check(model, ce_seq, x, y)
    assert probe.squared_norms().shape == (1,)
    assert torch.isfinite(probe.squared_norms()).all()


def test_broadcast_input_listed_uncovered() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(broadcast_pos=True)
    x, y = torch.randint(0, 11, (4, 7)), torch.randint(0, 11, (4, 7))
    probe = check(model, ce_seq, x, y)
    assert probe.uncovered == ["pos.weight"]
    assert "batch dimension" in probe.reasons["pos.weight"]


def test_parameter_used_outside_its_module_is_reported() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            return F.linear(torch.tanh(self.a(x)), self.b.weight)  # self.b's forward never runs

    model = Functional()
    probe = probe_run(model, F.cross_entropy, torch.randn(3, 4), torch.randint(0, 2, (3,)))
    per = probe.per_parameter()
    # b.bias gets no gradient at all: covered, with per-example norms of zero
    assert set(per) == {"a.weight", "a.bias", "b.bias"} == set(probe.covered)
    assert torch.equal(per["b.bias"], torch.zeros(3))
    assert "b.weight" in probe.uncovered and "b.weight" not in probe.covered


class FunctionalTie(nn.Module):
    """GPT-2 style tying: the embedding matrix is reused by a functional call outside its module."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 8)
        self.ln = nn.LayerNorm(8)
        self.mix = nn.Linear(8, 8)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.mix(self.ln(self.tok(idx)))
        return F.linear(h, self.tok.weight)


def test_functional_reuse_of_a_covered_parameter_is_detected() -> None:
    torch.manual_seed(0)
    model = FunctionalTie()
    x, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
    probe = check(model, ce_seq, x, y)  # the remaining parameters stay exact
    assert probe.uncovered == ["tok.weight"]
    assert "outside its module" in probe.reasons["tok.weight"]
    # without the check the embedding's norms would be silently wrong
    unchecked = probe_run(model, ce_seq, x, y, verify=False)
    ref = oracle(model, ce_seq, x, y)
    assert rel_err(unchecked.per_parameter()["tok.weight"], ref["tok.weight"]) > 0.01


def test_accumulates_over_backward_passes_and_reset() -> None:
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    with PerExampleGradNorms(model) as probe:
        for sl in (slice(0, 5), slice(5, 8)):
            F.cross_entropy(model(x[sl]), y[sl]).backward()
    ref = oracle(model, F.cross_entropy, x, y)
    assert rel_err(probe.squared_norms(), torch.stack(list(ref.values())).sum(0)) <= TOL
    probe.reset()
    with pytest.raises(RuntimeError, match="recorded nothing"):
        model.zero_grad(set_to_none=True)
        probe.squared_norms()


def test_memory_cap_falls_back_to_gram_and_stays_exact() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    x, y = torch.randint(0, 11, (4, 7)), torch.randint(0, 11, (4, 7))
    with PerExampleGradNorms(model, max_fused_bytes=0):
        assert all("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))
    probe = check(model, ce_seq, x, y, max_fused_bytes=0)  # no fused layer, no materialised copy
    assert probe.uncovered == []
    cnn = CNN()
    check(cnn, F.cross_entropy, torch.randn(5, 3, 8, 8), torch.randint(0, 5, (5,)), max_fused_bytes=0)


def test_fused_linear_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    x, y = torch.randint(0, 11, (4, 7)), torch.randint(0, 11, (4, 7))
    ce_seq(model(x), y).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    probe_run(model, ce_seq, x, y, linear_strategy="fused")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-7)
    assert "forward" not in model.head.__dict__  # the plain forward is back after the context


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 20])  # one example at a time, or one batched matmul
def test_fused_under_cpu_autocast_close_to_fp32(monkeypatch, chunk_bytes: int) -> None:
    from lightning_monitor.probes import per_example

    monkeypatch.setattr(per_example, "CPU_CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    model = TinyTransformer()
    x, y = torch.randint(0, 11, (4, 7)), torch.randint(0, 11, (4, 7))
    ref = oracle(model, ce_seq, x, y)
    model.zero_grad()
    with PerExampleGradNorms(model) as probe, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ce_seq(model(x), y)
    loss.backward()
    assert probe.squared_norms().dtype == torch.float32
    total = torch.stack([ref[n] for n in probe.covered]).sum(0)
    assert rel_err(probe.squared_norms(), total) < 0.05  # bf16 activations: close, not exact


def test_hooks_removed_on_exit() -> None:
    model = MLP()
    with PerExampleGradNorms(model) as probe:
        assert probe.active
        assert model.ln._forward_hooks and "forward" in model.fc1.__dict__  # hook / fused forward
    assert not probe.active
    assert all(not m._forward_hooks and "forward" not in m.__dict__ for m in model.modules())
    with PerExampleGradNorms(model, linear_strategy="gram"):
        assert model.fc1._forward_hooks and "forward" not in model.fc1.__dict__


def test_ddp_wrapped_model(tmp_path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = MLP()
        ddp = DistributedDataParallel(model)
        x, y = torch.randn(6, 12), torch.randint(0, 5, (6,))
        probe = probe_run(ddp, F.cross_entropy, x, y)
        assert set(probe.covered) == {n for n, _ in model.named_parameters()}  # no "module." prefix
        ref = oracle(model, F.cross_entropy, x, y)
        assert rel_err(probe.squared_norms(), torch.stack(list(ref.values())).sum(0)) <= TOL
        # the DDP wrapper is freed while its process group lives: freed later, by the garbage collector after the
        # group was destroyed, its reducer deadlocked this process now and then
        del probe, ddp
        gc.collect()
    finally:
        if owns_group:
            dist.destroy_process_group()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="loss_reduction"):
        PerExampleGradNorms(MLP(), loss_reduction="none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="linear_strategy"):
        PerExampleGradNorms(MLP(), linear_strategy="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_fused_bytes"):
        PerExampleGradNorms(MLP(), max_fused_bytes=-1)
    with pytest.raises(TypeError, match="module"):
        PerExampleGradNorms(lambda x: x)  # type: ignore[arg-type]


def test_no_grad_forward_records_nothing() -> None:
    model = MLP()
    with PerExampleGradNorms(model) as probe, torch.no_grad():
        model(torch.randn(3, 12))
    with pytest.raises(RuntimeError, match="recorded nothing"):
        probe.squared_norms()


@pytest.mark.parametrize("chunk_bytes", [1, 2500])
def test_fused_linear_in_chunks_of_examples_exact(monkeypatch, chunk_bytes: int) -> None:
    """The CPU path forms the per-example gradients a chunk of examples at a time (1 here, or 1 to 3 per
    layer with a partial last chunk): norms and the weight gradient stay exact, tied weights included."""
    from lightning_monitor.probes import per_example

    monkeypatch.setattr(per_example, "CPU_CHUNK_BYTES", chunk_bytes)
    for tied in (False, True):
        torch.manual_seed(0)
        model = TinyTransformer(tied=tied)
        x, y = torch.randint(0, 11, (5, 7)), torch.randint(0, 11, (5, 7))
        ce_seq(model(x), y).backward()
        plain = {n: p.grad.clone() for n, p in model.named_parameters()}
        probe = check(model, ce_seq, x, y, linear_strategy="fused")
        assert probe.uncovered == []
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    model = TwiceUsed()
    check(model, ce_seq, torch.randn(5, 4, 6), torch.randint(0, 3, (5, 4)))



@pytest.mark.parametrize("chunk_bytes, fused", [(1, True), (1 << 20, False)])
def test_memory_cap_counts_the_chunk_held_at_once(monkeypatch, chunk_bytes: int, fused: bool) -> None:
    """The cap applies to the per-example gradients held at once: one example's fits, five do not."""
    from lightning_monitor.probes import per_example

    monkeypatch.setattr(per_example, "CPU_CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3))
    x, y = torch.randn(5, 32, 16), torch.randint(0, 3, (5, 32))  # T = 32: fused is the cheaper form
    cap = 2 * 4 * 16 * 64  # two examples of the first layer
    with PerExampleGradNorms(model, max_fused_bytes=cap):
        out = model[0](x)
    assert (type(out.grad_fn).__name__ == "_FusedLinearBackward") == fused
    check(model, ce_seq, x, y, max_fused_bytes=cap)


@pytest.mark.parametrize("t, fused", [(3, False), (40, True)])
def test_auto_prefers_gram_on_short_sequences(t: int, fused: bool) -> None:
    """auto: Gram form when T^2 (d_in + d_out) < 8 d_in d_out (here 32 x 64: T <= 13), else fused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 3))
    x, y = torch.randn(4, t, 32), torch.randint(0, 3, (4, t))
    with PerExampleGradNorms(model):
        out = model[0](x)
    assert (type(out.grad_fn).__name__ == "_FusedLinearBackward") == fused
    check(model, ce_seq, x, y)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1, 3000, 1 << 20])
def test_per_example_linear_against_einsum(monkeypatch, dtype: torch.dtype, chunk_bytes: int) -> None:
    from lightning_monitor.probes import per_example

    monkeypatch.setattr(per_example, "CPU_CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    a, d = torch.randn(7, 9, 12).to(dtype), torch.randn(7, 9, 20).to(dtype)
    total, sq = per_example.per_example_linear(a, d)
    g = torch.einsum("bto,bti->boi", d.double(), a.double())
    assert sq.dtype == torch.float32 and sq.shape == (7,)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: each G_i is rounded to 8 bits of mantissa
    assert rel_err(sq, g.pow(2).sum((1, 2))) <= tol
    err = (total.double() - g.sum(0)).abs().max() / g.sum(0).abs().max()
    assert float(err) <= tol


if __name__ == "__main__":  # pragma: no cover
    os.sys.exit(pytest.main([__file__, "-q"]))


class _BareAndParametrized(nn.Module):
    """A Linear whose weight is parametrized (weight_norm) and a bias used directly in the module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.utils.parametrizations.weight_norm(nn.Linear(6, 3))
        self.head = nn.Linear(3, 3)
        self.shift = nn.Parameter(torch.zeros(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lin(x)) + self.shift


def test_parameters_left_out_are_named_for_what_they_are() -> None:
    # both were "no handler for its module type (ParametrizationList)" and "(_BareAndParametrized)"
    torch.manual_seed(0)
    probe = PerExampleGradNorms(_BareAndParametrized())
    weight = [n for n in probe.reasons if n.startswith("lin.parametrizations.weight")]
    assert weight and all("a parametrized weight" in probe.reasons[n] for n in weight)
    assert "(_BareAndParametrized), whose own forward uses it directly" in probe.reasons["shift"]
