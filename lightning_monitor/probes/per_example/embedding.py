"""``nn.Embedding``: the rows an example touches, ``sum_{t: x_t = v} d_t`` summed per (example, distinct
token), squared; ``padding_idx`` rows get no gradient. ``scale_grad_by_freq`` is not covered.

Hugging Face's scaled word embeddings (Gemma 1-3's ``embedding(x) * embed_scale`` with the scale a buffer cast to
the weight's dtype; BART's, mBART's, M2M-100's ... with the scale a float), checked on the bytecode of their
``forward`` and registered by name: the same rows, with the output gradient times the scale."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_monitor.probes.per_example.norm import _same_code
from lightning_monitor.probes.per_example.registry import Handler, register, register_by_name


def _rows(m: nn.Module, idx: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per (example, distinct token) summed output gradients: (rows [U, d], example of each row, token)."""
    b = idx.shape[0]
    dim = m.embedding_dim
    ids = idx.reshape(b, -1)
    d = g.reshape(b, -1, dim).float()
    keys = ids + m.num_embeddings * torch.arange(b, device=ids.device).unsqueeze(1)
    if m.padding_idx is not None:
        keep = ids.reshape(-1) != m.padding_idx
        flat_keys, flat_d = keys.reshape(-1)[keep], d.reshape(-1, dim)[keep]
    else:
        flat_keys, flat_d = keys.reshape(-1), d.reshape(-1, dim)
    uniq, inverse = torch.unique(flat_keys, return_inverse=True)
    rows = torch.zeros(uniq.numel(), dim, device=d.device, dtype=torch.float32).index_add_(0, inverse, flat_d)
    return rows, torch.div(uniq, m.num_embeddings, rounding_mode="floor"), uniq % m.num_embeddings


@register(nn.Embedding)
class EmbeddingHandler(Handler):
    def unsupported(self, m: nn.Module) -> Optional[str]:
        return "scale_grad_by_freq couples the examples of a batch" if m.scale_grad_by_freq else None

    def param_names(self, m: nn.Module) -> tuple[str, ...]:
        return ("weight",)

    def capture(self, m: nn.Module, idx: Tensor) -> Any:
        # an integer index tensor; anything else is the input of a subclass with a forward of its own (OPT's
        # learned positions take the attention mask and index with positions computed inside): not this handler's
        integer = not (idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool)
        if idx.dim() < 1 or not integer:
            return None
        if type(m).forward is not nn.Embedding.forward:
            # a subclass with a forward of its own may take indices it does not look up (Whisper's learned
            # positions take the token ids and slice positions): kept inside the table, so that no index falls
            # outside it (on CUDA a device-side assert, which ends the process); whether the module computes what
            # this handler assumes is the probe's verification's to find (it leaves such a parameter out)
            idx = idx.clamp(0, m.num_embeddings - 1)
        return idx

    def batch_dims(self, m: nn.Module, idx: Tensor) -> int:
        return idx.dim()

    def patch_forward(self, m: nn.Module, uses: Any, rule: Any) -> Optional[Callable[..., Any]]:
        """A subclass with a forward of its own (OPT's and BART's learned positions take the attention mask or the
        token ids and compute the positions they look up inside): its forward runs with
        ``torch.nn.functional.embedding`` intercepted, and each lookup in this module's table is a use, on the
        indices it really looks up. A forward that reads the table otherwise (Whisper's positions slice its rows)
        records no use, and the module is left out with that reason. The plain ``nn.Embedding`` takes a forward
        hook."""
        if type(m).forward is nn.Embedding.forward:
            return None
        own = m.forward

        def patched(*args: Any, **kwargs: Any) -> Any:
            before, looked = F.embedding, []

            def lookup(idx: Any, weight: Any, *rest: Any, **options: Any) -> Tensor:
                out = before(idx, weight, *rest, **options)
                if weight is m.weight and isinstance(idx, Tensor):
                    looked.append(True)
                    if uses.note(idx) == "record":
                        uses.record(idx, out, rule)
                return out

            F.embedding = lookup
            try:
                out = own(*args, **kwargs)
            finally:
                F.embedding = before
            if not looked and torch.is_grad_enabled():
                uses.probe._refused.setdefault(uses.name, (
                    f"its forward ({type(m).__name__}) reads its table without a lookup (a slice of its rows, say), "
                    "which has no per-example rule here"))
            return out

        return patched

    def sq_norms(self, m: nn.Module, idx: Tensor, g: Tensor, rule: Any) -> dict[str, Tensor]:
        rows, example, _ = _rows(m, idx, g)
        sq = torch.zeros(idx.shape[0], device=rows.device, dtype=torch.float32)
        return {"weight": sq.index_add_(0, example, rows.pow(2).sum(1))}

    def grads(self, m: nn.Module, idx: Tensor, g: Tensor) -> dict[str, Tensor]:
        rows, example, token = _rows(m, idx, g)
        out = torch.zeros(idx.shape[0], m.num_embeddings, m.embedding_dim, device=rows.device, dtype=torch.float32)
        out[example, token] = rows
        return {"weight": out}

    def project(self, m: nn.Module, idx: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        u, v = uv["weight"]
        ids = idx.reshape(-1)
        d = g.reshape(-1, m.embedding_dim).float()
        if m.padding_idx is not None:
            keep = ids != m.padding_idx
            ids, d = ids[keep], d[keep]
        return {"weight": (u[:, ids] * (v @ d.T)).sum(1)}


_GEMMA_SCALED = ("transformers.models.gemma3.modeling_gemma3", "Gemma3TextScaledWordEmbedding")
_BART_SCALED = ("transformers.models.bart.modeling_bart", "BartScaledWordEmbedding")
_HF = "transformers.models."


class _ScaledEmbeddingHandler(EmbeddingHandler):
    """``nn.Embedding.forward(x) * embed_scale``: the gradient reaching the table is the output's times the scale."""

    def unsupported(self, m: nn.Module) -> Optional[str]:
        scale = getattr(m, "embed_scale", None)
        if not isinstance(scale, (int, float, Tensor)) or isinstance(scale, bool) or (
                isinstance(scale, Tensor) and scale.numel() != 1):
            return "no scalar embed_scale"
        return super().unsupported(m)

    @staticmethod
    def _scaled(m: nn.Module, g: Tensor) -> Tensor:
        scale = m.embed_scale
        if isinstance(scale, Tensor):  # on the device: no host sync
            return g.float() * scale.to(m.weight.dtype).float()
        return g.float() * float(scale)

    def sq_norms(self, m: nn.Module, idx: Tensor, g: Tensor, rule: Any) -> dict[str, Tensor]:
        return super().sq_norms(m, idx, self._scaled(m, g), rule)

    def grads(self, m: nn.Module, idx: Tensor, g: Tensor) -> dict[str, Tensor]:
        return super().grads(m, idx, self._scaled(m, g))

    def project(self, m: nn.Module, idx: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        return super().project(m, idx, self._scaled(m, g), uv)

    def patch_forward(self, m: nn.Module, uses: Any, rule: Any) -> Optional[Callable[..., Any]]:
        return None  # the module's output (the lookup times the scale) is hooked


register_by_name(*(_HF + n for n in (
    "gemma.modeling_gemma.GemmaTextScaledWordEmbedding",
    "gemma2.modeling_gemma2.Gemma2TextScaledWordEmbedding",
    "gemma3.modeling_gemma3.Gemma3TextScaledWordEmbedding",
    "gemma3n.modeling_gemma3n.Gemma3nTextScaledWordEmbedding",
    "vaultgemma.modeling_vaultgemma.VaultGemmaTextScaledWordEmbedding",
    "minicpm3.modeling_minicpm3.MiniCPM3ScaledWordEmbedding",
)), when=lambda cls: _same_code(cls, _GEMMA_SCALED))(_ScaledEmbeddingHandler)
register_by_name(*(_HF + n for n in (
    "bart.modeling_bart.BartScaledWordEmbedding",
    "mbart.modeling_mbart.MBartScaledWordEmbedding",
    "plbart.modeling_plbart.PLBartScaledWordEmbedding",
    "m2m_100.modeling_m2m_100.M2M100ScaledWordEmbedding",
    "blenderbot.modeling_blenderbot.BlenderbotScaledWordEmbedding",
    "bigbird_pegasus.modeling_bigbird_pegasus.BigBirdPegasusScaledWordEmbedding",
    "biogpt.modeling_biogpt.BioGptScaledWordEmbedding",
    "xglm.modeling_xglm.XGLMScaledWordEmbedding",
    "trocr.modeling_trocr.TrOCRScaledWordEmbedding",
    "pegasus_x.modeling_pegasus_x.PegasusXScaledWordEmbedding",
    "nllb_moe.modeling_nllb_moe.NllbMoeScaledWordEmbedding",
)), when=lambda cls: _same_code(cls, _BART_SCALED))(_ScaledEmbeddingHandler)
