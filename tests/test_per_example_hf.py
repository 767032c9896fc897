"""Hugging Face module types in the per-example probe (``transformers.pytorch_utils.Conv1D``, Llama's
RMSNorm), registered by name, against torch.func; and whole tiny random-init HF models."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_per_example import ce_seq, check
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")

from transformers.pytorch_utils import Conv1D  # noqa: E402


class GPT2Like(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = Conv1D(12, 5)  # nf=12 outputs, nx=5 inputs: weight [5, 12]
        self.c_proj = Conv1D(3, 12)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


@pytest.mark.parametrize("shape", [(6, 5), (4, 7, 5)])
@pytest.mark.parametrize("strategy", ["auto", "gram", "materialize"])
def test_conv1d_transposed_linear_exact(shape: tuple[int, ...], strategy: str) -> None:
    torch.manual_seed(0)
    model = GPT2Like()
    x, y = torch.randn(*shape), torch.randint(0, 3, shape[:-1])
    probe = check(model, ce_seq, x, y, linear_strategy=strategy)
    assert probe.uncovered == []


def test_conv1d_used_twice_exact() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = Conv1D(5, 5)
            self.b = Conv1D(3, 5)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))

    torch.manual_seed(0)
    probe = check(Twice(), ce_seq, torch.randn(4, 3, 5), torch.randint(0, 3, (4, 3)))
    assert probe.uncovered == []


@pytest.mark.parametrize("path", [
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
    "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm",
    "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm",
    # registered by no name: the same code as Llama's, Gemma's or OLMo2's under another name (left out before, "no
    # handler for its module type")
    "transformers.models.zamba2.modeling_zamba2.Zamba2RMSNorm",
    "transformers.models.granitemoe.modeling_granitemoe.GraniteMoeRMSNorm",
    "transformers.models.jamba.modeling_jamba.JambaRMSNorm",
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridRMSNorm",
])
def test_hf_rmsnorms_exact(path: str) -> None:
    """Llama's ``w * xhat.to(dtype)``, Gemma's ``(xhat * (1 + w))`` and OLMo2's ``(w * xhat)``, both with ``xhat`` in
    fp32, against torch.func."""
    import importlib

    module, name = path.rsplit(".", 1)
    try:
        norm_cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.skip(f"{name} is not in this transformers")

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(5, 8)
            self.norm = norm_cls(8, eps=1e-6)
            self.out = nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.out(self.norm(self.inp(x)))

    torch.manual_seed(0)
    model = M()
    with torch.no_grad():
        model.norm.weight.uniform_(-0.5, 1.5)
    probe = check(model, ce_seq, torch.randn(4, 6, 5), torch.randint(0, 3, (4, 6)))
    assert probe.uncovered == []
    assert "norm.weight" in probe.covered


def test_rmsnorm_with_other_code_is_not_covered() -> None:
    """A class registered by name whose code is not its family's (here one named as Gemma3's, computing
    ``w * xhat`` the Llama way with another epsilon) is left to no handler, not guessed."""
    from lightning_monitor import PerExampleGradNorms

    class Gemma3RMSNorm(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.eps = 1e-6
            self.weight = nn.Parameter(torch.ones(dim))

        def _norm(self, x: Tensor) -> Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3)

        def forward(self, x: Tensor) -> Tensor:
            return self.weight * self._norm(x.float()).type_as(x)

    Gemma3RMSNorm.__module__ = "transformers.models.gemma3.modeling_gemma3"
    model = nn.Sequential(nn.Linear(4, 8), Gemma3RMSNorm(8))
    probe = PerExampleGradNorms(model)
    assert probe.uncovered == ["1.weight"]


def test_a_norm_of_other_code_under_no_registered_name_is_not_covered() -> None:
    """The code match is the code: a class named like the copies, computing another epsilon's RMSNorm, has no
    handler."""
    from lightning_monitor import PerExampleGradNorms

    class CustomRMSNorm(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.variance_epsilon = 1e-6
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x: Tensor) -> Tensor:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-3))

    probe = PerExampleGradNorms(nn.Sequential(nn.Linear(4, 8), CustomRMSNorm(8)))
    assert probe.uncovered == ["1.weight"]


def _tiny_gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=37, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _tiny_llama() -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg)


def _tiny_opt() -> nn.Module:
    cfg = transformers.OPTConfig(vocab_size=37, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
                                 max_position_embeddings=16, word_embed_proj_dim=16, dropout=0.0)
    return transformers.OPTForCausalLM(cfg)


def _tiny_gemma() -> nn.Module:
    cfg = transformers.GemmaConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=16)
    return transformers.GemmaForCausalLM(cfg)


class Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


@pytest.mark.parametrize("make", [_tiny_gpt2, _tiny_llama], ids=["gpt2", "llama"])
def test_hf_causal_lm_exact(make) -> None:
    """Every parameter but the position embedding (GPT-2's ``wpe`` is indexed by positions broadcast
    over the batch, here with block size == batch size) is covered and exact."""
    torch.manual_seed(0)
    model = Logits(make())
    model.model.config._attn_implementation = "eager"  # torch.func's reference: no fused-kernel batching rule needed
    x, y = torch.randint(0, 37, (8, 8)), torch.randint(0, 37, (8, 8))
    probe = check(model, ce_seq, x, y)
    expected = {"model.transformer.wpe.weight"} if make is _tiny_gpt2 else set()
    assert set(probe.uncovered) == expected
    if expected:
        assert "no batch dimension" in probe.reasons["model.transformer.wpe.weight"]


def test_subclasses_with_a_forward_of_their_own_covered_and_exact() -> None:
    """Subclasses of ``nn.Embedding`` with a forward of their own: OPT's learned positions take the attention mask
    and look up positions computed inside; Gemma's scaled embedding multiplies the rows by sqrt(d). Neither may
    crash the backward (OPT's did: the mask was used as indices) nor be counted wrong. OPT's lookup is intercepted
    (the indices it really looks up, per example from the mask) and its MLPs see the batch folded with the positions
    (``(B * T, d)``, example-major): every parameter covered, exact against torch.func. Gemma's scaled embedding and
    RMSNorm (``1 + w``) have handlers of their own: covered, exact."""
    probes = {}
    for make in (_tiny_opt, _tiny_gemma):
        torch.manual_seed(0)
        model = Logits(make())
        model.model.config._attn_implementation = "eager"
        x, y = torch.randint(0, 37, (8, 8)), torch.randint(0, 37, (8, 8))
        probes[make] = probe = check(model, ce_seq, x, y)
        assert probe.uncovered == [], make.__name__
    assert {"model.model.decoder.embed_positions.weight",
            *(f"model.model.decoder.layers.{i}.{m}.{p}" for i in (0, 1) for m in ("fc1", "fc2", "final_layer_norm")
              for p in ("weight", "bias"))} <= set(probes[_tiny_opt].covered)
    # Gemma ties its scaled embedding (`embedding(x) * embed_scale`, a handler of its own) to its output head: both
    # uses are hooked, every parameter exact
    assert "model.model.embed_tokens.weight" in probes[_tiny_gemma].covered


def _tiny_bart() -> nn.Module:
    cfg = transformers.BartConfig(vocab_size=37, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                  max_position_embeddings=16, scale_embedding=True, dropout=0.0)
    return transformers.BartForCausalLM(cfg)


@pytest.mark.parametrize("make", [_tiny_gemma, _tiny_bart])
def test_scaled_word_embeddings_exact(make) -> None:
    """Gemma's ``embedding(x) * embed_scale`` (a buffer) and BART's (a float, sqrt(d) with ``scale_embedding``):
    covered by the scaled handler, exact against torch.func, tied to the output head or not."""
    torch.manual_seed(0)
    model = Logits(make())
    model.model.config._attn_implementation = "eager"
    emb = model.model.get_input_embeddings()
    if not hasattr(emb, "embed_scale"):  # older transformers (4.x) scale the embedding's output in the model's forward
        pytest.skip(f"transformers {transformers.__version__}'s {type(model.model).__name__} has no scaled embedding "
                    f"module (its {type(emb).__name__} has no `embed_scale`)")
    scale = emb.embed_scale
    assert float(scale) != 1.0
    probe = check(model, ce_seq, torch.randint(0, 37, (8, 8)), torch.randint(0, 37, (8, 8)))
    name = next(n for n, p in model.named_parameters() if p is emb.weight)
    assert name in probe.covered


def _tiny_biogpt() -> nn.Module:
    cfg = transformers.BioGptConfig(vocab_size=37, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    return transformers.BioGptForCausalLM(cfg)


@pytest.mark.parametrize("make, positions", [(_tiny_bart, "model.model.decoder.embed_positions.weight"),
                                             (_tiny_biogpt, "model.biogpt.embed_positions.weight")],
                         ids=["bart", "biogpt"])
def test_learned_positions_looked_up_inside_their_forward(make, positions: str) -> None:
    """BART's and BioGPT's learned positions (``nn.Embedding`` subclasses taking the token ids or the mask): the
    lookup inside their forward is the use read, on the positions it really looks up, the same for every example
    here: no batch dimension, left out with that reason (before, the token ids were taken for the indices and only
    the verification caught it); every other parameter exact against torch.func."""
    torch.manual_seed(0)
    model = Logits(make())
    model.model.config._attn_implementation = "eager"
    x, y = torch.randint(2, 37, (6, 8)), torch.randint(0, 37, (6, 8))
    probe = check(model, ce_seq, x, y)
    # the indices the positions' lookup really gets: `[1, T]` in current transformers (position ids broadcast over the
    # batch); older ones (4.40) expand them to `[B, T]` inside the forward, a batch dimension whose rows are looked up
    # per example: covered then, and exact (checked above)
    weight, shapes = model.get_parameter(positions), []
    embedding = F.embedding

    def spy(indices: Tensor, w: Tensor, *args, **kwargs) -> Tensor:
        if w is weight:
            shapes.append(tuple(indices.shape))
        return embedding(indices, w, *args, **kwargs)

    with torch.no_grad(), mock.patch.object(F, "embedding", spy):
        model(x)
    (shape,) = shapes
    if shape[0] == len(x):
        assert probe.uncovered == [] and positions in probe.covered
        return
    assert probe.uncovered == [positions]
    assert "no batch dimension" in probe.reasons[positions]
