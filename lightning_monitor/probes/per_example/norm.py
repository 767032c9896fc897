"""Normalisation layers: per example, weight ``sum_t d_t * xhat_t`` and bias ``sum_t d_t`` (``xhat`` the
normalised input, recomputed in fp32 as the layer computes it), squared.

* ``nn.LayerNorm`` and ``nn.RMSNorm`` (``eps=None`` is the epsilon of the type torch computes in: fp32
  for fp16/bf16 inputs, as ``F.rms_norm`` does);
* the RMSNorm of Hugging Face Llama and of the models whose ``forward`` is the same code (Mistral,
  Qwen2/3, Phi-3 ...: checked on the bytecode, registered by name so that ``transformers`` is never
  imported here): ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, normalised in fp32. A class of
  another name whose name holds "Norm" and whose code is one of these three families' gets its handler too,
  once ``transformers`` is imported (about 150 model files copy them under their own names: Jamba, Zamba2,
  GraniteMoE, Mamba ...);
* the RMSNorm of Hugging Face Gemma (Gemma 1-3, Qwen3-Next ...: the same ``forward`` and ``_norm`` code):
  ``(xhat * (1 + weight)).type_as(x)`` with ``xhat`` and the product in fp32, and of OLMo2 (OLMo 2/3, GPT-OSS
  ...): ``(weight * xhat).to(x.dtype)`` with ``xhat`` in fp32; in both the weight's gradient is
  ``sum_t d_t * xhat_t`` with ``xhat`` in fp32;
* ``nn.GroupNorm``: per channel, over the spatial positions (``xhat`` normalised per group).

``nn.BatchNorm*`` is covered in eval mode only (running statistics: an affine map per channel). In training mode its
batch statistics couple the examples of a batch, so an example's gradient is not the gradient of a loss of that
example alone: such a call is refused and its parameters are left out.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_monitor.probes.per_example.kernels import project_matrix
from lightning_monitor.probes.per_example.registry import Handler, register, register_by_code, register_by_name

_LLAMA_RMSNORM = ("transformers.models.llama.modeling_llama", "LlamaRMSNorm")
#: Hugging Face RMSNorm classes whose forward is checked to be Llama's (see :func:`_computes_as_llama`).
HF_RMSNORMS = (
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
    "transformers.models.mixtral.modeling_mixtral.MixtralRMSNorm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeRMSNorm",
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
    "transformers.models.phi3.modeling_phi3.Phi3RMSNorm",
    "transformers.models.granite.modeling_granite.GraniteRMSNorm",
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm",
    "transformers.models.smollm3.modeling_smollm3.SmolLM3RMSNorm",
)


def _opmath_eps(dtype: torch.dtype) -> float:
    """The epsilon ``F.rms_norm`` uses for ``eps=None``: that of the type it computes in (fp32 for fp16 and
    bf16 inputs, fp64 for fp64)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _normalized(m: nn.Module, x: Tensor) -> Tensor:
    shape = tuple(m.normalized_shape)
    xf = x.float()
    if isinstance(m, nn.LayerNorm):
        return F.layer_norm(xf, shape, None, None, m.eps)
    eps = m.eps if m.eps is not None else _opmath_eps(x.dtype)
    return F.rms_norm(xf, shape, None, eps)


class NormHandler(Handler):
    def param_names(self, m: nn.Module) -> tuple[str, ...]:
        return ("weight", "bias")

    def batch_dims(self, m: nn.Module, x: Tensor) -> int:
        return max(x.dim() - len(tuple(m.normalized_shape)), 0)

    def normalized(self, m: nn.Module, x: Tensor) -> Tensor:
        """The normalised input in fp32, as the layer computes it."""
        return _normalized(m, x)

    def feature_shape(self, m: nn.Module) -> tuple[int, ...]:
        return tuple(m.normalized_shape)

    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        with torch.no_grad():
            b = x.shape[0]
            xhat = self.normalized(m, x)
            d = g.float()
            keep = (b, -1) + self.feature_shape(m)
            out: dict[str, Tensor] = {}
            if getattr(m, "weight", None) is not None:
                out["weight"] = (d * xhat).reshape(keep).sum(1)
            if getattr(m, "bias", None) is not None:
                out["bias"] = d.reshape(keep).sum(1)
            return out

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: Any) -> dict[str, Tensor]:
        return {k: v.pow(2).flatten(1).sum(1) for k, v in self.grads(m, x, g).items()}

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        per = self.grads(m, x, g)
        return {k: project_matrix(per[k].sum(0), *uv[k]) for k in uv}


register(nn.LayerNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))(NormHandler)


def _same_code(cls: type, reference: tuple[str, str], methods: tuple[str, ...] = ("forward",)) -> bool:
    """Whether each of ``methods`` of ``cls`` is the same code as that of the Hugging Face class ``reference``
    (module, name): the model file defining ``cls`` is loaded; the reference is imported from the same library if
    it is not."""
    try:
        ref_cls = getattr(importlib.import_module(reference[0]), reference[1])
        pairs = [(getattr(cls, m).__code__, getattr(ref_cls, m).__code__) for m in methods]
    except (ImportError, AttributeError):
        return False
    return all(code.co_code == ref.co_code and code.co_names == ref.co_names and code.co_consts == ref.co_consts
               for code, ref in pairs)


def _hf_loaded() -> bool:
    """Whether ``transformers`` is imported already (a class matched by its code is compared with Hugging Face's
    only then: a model without it never imports it)."""
    return "transformers" in sys.modules


def _computes_as_llama(cls: type) -> bool:
    """Whether ``cls.forward`` is the same code as Hugging Face's ``LlamaRMSNorm.forward``."""
    return _same_code(cls, _LLAMA_RMSNORM)


@register_by_code("Norm", when=lambda cls: _hf_loaded() and _computes_as_llama(cls))
@register_by_name(*HF_RMSNORMS, when=_computes_as_llama)
class HFRMSNormHandler(NormHandler):
    """``weight * (x * rsqrt(mean(x^2, -1) + variance_epsilon)).to(x.dtype)``, normalised in fp32."""

    def unsupported(self, m: nn.Module) -> Optional[str]:
        w = getattr(m, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 1 or not hasattr(m, "variance_epsilon"):
            return "not the Llama RMSNorm layout (a 1-D weight and variance_epsilon)"
        return None

    def batch_dims(self, m: nn.Module, x: Tensor) -> int:
        return max(x.dim() - 1, 0)

    def feature_shape(self, m: nn.Module) -> tuple[int, ...]:
        return tuple(m.weight.shape)

    def normalized(self, m: nn.Module, x: Tensor) -> Tensor:
        xf = x.float()
        xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
        return xhat.to(x.dtype).float()


_GEMMA_RMSNORM = ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm")
#: Hugging Face RMSNorm classes whose ``forward`` and ``_norm`` are checked to be Gemma's.
HF_GEMMA_RMSNORMS = (
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
    "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm",
    "transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm",
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRMSNorm",
    "transformers.models.t5gemma.modeling_t5gemma.T5GemmaRMSNorm",
    "transformers.models.vaultgemma.modeling_vaultgemma.VaultGemmaRMSNorm",
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm",
)
_OLMO2_RMSNORM = ("transformers.models.olmo2.modeling_olmo2", "Olmo2RMSNorm")
#: Hugging Face RMSNorm classes whose ``forward`` is checked to be OLMo2's.
HF_OLMO2_RMSNORMS = (
    "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm",
    "transformers.models.olmo3.modeling_olmo3.Olmo3RMSNorm",
    "transformers.models.flex_olmo.modeling_flex_olmo.FlexOlmoRMSNorm",
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm",
)


class _Fp32RMSNormHandler(HFRMSNormHandler):
    """An RMSNorm whose weight multiplies the fp32 normalised input (``xhat`` not rounded to the input's dtype
    first); ``eps_attribute`` names its epsilon."""

    eps_attribute = "variance_epsilon"

    def unsupported(self, m: nn.Module) -> Optional[str]:
        w = getattr(m, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 1 or not hasattr(m, self.eps_attribute):
            return f"not the RMSNorm layout of its family (a 1-D weight and {self.eps_attribute})"
        return None

    def normalized(self, m: nn.Module, x: Tensor) -> Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + getattr(m, self.eps_attribute))


@register_by_code("Norm", when=lambda cls: _hf_loaded() and hasattr(cls, "_norm")
                  and _same_code(cls, _GEMMA_RMSNORM, ("forward", "_norm")))
@register_by_name(*HF_GEMMA_RMSNORMS, when=lambda cls: _same_code(cls, _GEMMA_RMSNORM, ("forward", "_norm")))
class HFGemmaRMSNormHandler(_Fp32RMSNormHandler):
    """``(xhat * (1 + weight)).type_as(x)``, ``xhat = x * rsqrt(mean(x^2, -1) + eps)`` and the product in fp32:
    the weight's gradient is ``sum_t d_t * xhat_t`` (the offset 1 does not enter it)."""

    eps_attribute = "eps"


@register_by_code("Norm", when=lambda cls: _hf_loaded() and _same_code(cls, _OLMO2_RMSNORM))
@register_by_name(*HF_OLMO2_RMSNORMS, when=lambda cls: _same_code(cls, _OLMO2_RMSNORM))
class HFOlmo2RMSNormHandler(_Fp32RMSNormHandler):
    """``(weight * xhat).to(x.dtype)``, ``xhat = x * rsqrt(mean(x^2, -1) + variance_epsilon)`` in fp32."""


@register(nn.GroupNorm)
class GroupNormHandler(NormHandler):
    """Input ``[N, C, *]``: per channel ``c``, weight ``sum_l d_cl * xhat_cl``, bias ``sum_l d_cl``."""

    def capture(self, m: nn.Module, x: Tensor) -> Any:
        return x if x.dim() >= 2 else None

    def batch_dims(self, m: nn.Module, x: Tensor) -> int:
        return 1

    def channels(self, m: nn.Module, x: Tensor) -> Tensor:
        """The normalised input in fp32, ``[N, C, L]``."""
        return F.group_norm(x.float(), m.num_groups, None, None, m.eps).reshape(x.shape[0], x.shape[1], -1)

    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        with torch.no_grad():
            b, c = x.shape[:2]
            d = g.float().reshape(b, c, -1)
            out: dict[str, Tensor] = {}
            if m.weight is not None:
                out["weight"] = (d * self.channels(m, x)).sum(2)
            if m.bias is not None:
                out["bias"] = d.sum(2)
            return out


@register(nn.modules.batchnorm._BatchNorm)
class BatchNormHandler(GroupNormHandler):
    """Input ``[N, C, *]``. In training mode (or without running statistics) the layer normalises with its batch's
    statistics, which couple the examples: a call in that mode is refused, and its parameters are left out with that
    reason. In eval mode (statistics frozen, as when fine-tuning with the BatchNorms kept in eval) it is an affine map
    per channel, ``xhat = (x - running_mean) / sqrt(running_var + eps)``: per channel ``c``, weight
    ``sum_l d_cl * xhat_cl``, bias ``sum_l d_cl``."""

    def refusal(self, m: nn.Module, x: Tensor) -> Optional[str]:
        if m.training or m.running_mean is None or m.running_var is None:
            return ("its batch statistics couple the examples of a batch (in training mode), so an example's "
                    "gradient is not that of a loss of the example alone (in eval mode, with running statistics, "
                    "it is measured)")
        return None

    def channels(self, m: nn.Module, x: Tensor) -> Tensor:
        scale = torch.rsqrt(m.running_var.float() + m.eps)
        return (x.float().reshape(x.shape[0], x.shape[1], -1) - m.running_mean.float()[:, None]) * scale[:, None]
