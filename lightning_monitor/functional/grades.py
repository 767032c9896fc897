"""GradES: per-component convergence statistics and freezing (pure PyTorch, no Lightning).

Wen et al., "GradES: Significantly Faster Training in Transformers with Gradient-Based Early
Stopping", arXiv 2509.01842. Each weight matrix of a transformer block (attention q/k/v/o, MLP
gate/up/down, ``nn.MultiheadAttention``'s packed input projection and its ``out_proj``, or LoRA adapters)
is a *component*; once its statistic falls under a threshold after a
grace period, the component is frozen for good.

Two statistics, both element-wise means so that they do not grow with the size of the matrix:

* ``"grad"`` (the paper): ``g_c = mean_ij |dL/dW_ij|``, the L1 norm of the gradient divided by the
  number of elements;
* ``"update"`` (the released code): ``u_c = mean_ij |W_ij(t) - W_ij(t - k)| / k``, the weight change
  since the previous check ``k`` optimizer steps ago, per element and per step (the code uses the raw
  L1 sum ``||W_t - W_{t-1}||_1``, i.e. ``u_c * numel``).

The *relative* (scale-free) rule freezes ``c`` when ``s_c < tau * r_c``, where ``r_c`` is the mean of
the component's own statistic over its first few checks; the *absolute* rule when ``s_c < tau``.

:func:`block_container` and :func:`frozen_prefix` find the leading blocks whose matrices are all frozen
and what is left to freeze in them for the backward to stop at their end.

Example:
    >>> import torch
    >>> from torch import nn
    >>> blocks = nn.ModuleList(nn.ModuleDict({"q_proj": nn.Linear(4, 4), "ln": nn.LayerNorm(4)}) for _ in range(2))
    >>> model = nn.ModuleDict({"emb": nn.Embedding(10, 4), "blocks": blocks, "lm_head": nn.Linear(4, 10)})
    >>> sorted(find_components(model))
    ['blocks.0.q_proj', 'blocks.1.q_proj']
    >>> mean_abs([torch.tensor([[1.0, -3.0]]), torch.tensor([2.0])])
    tensor([2., 2.])
    >>> freeze_mask(torch.tensor([0.1, 0.5]), torch.tensor([1.0, 1.0]), tau=0.2)
    tensor([ True, False])
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Optional, Union

import torch
from torch import Tensor, nn

from lightning_monitor._compat import foreach_norm, foreach_sub
from lightning_monitor._sharded import _fsdp_module_type
from lightning_monitor.selection import linear_types

__all__ = [
    "Component",
    "PROJECTION_NAMES",
    "LORA_NAMES",
    "EXPERT_NAMES",
    "BARE_PROJECTION_NAMES",
    "find_components",
    "no_component_reason",
    "uncovered_matrices",
    "shared_outside",
    "mean_abs",
    "mean_abs_update",
    "relative_ratio",
    "freeze_mask",
    "ema_update",
    "freeze_parameters",
    "PrefixCut",
    "block_container",
    "frozen_prefix",
]

#: Leaf names of projection matrices, by naming scheme. Adding a scheme is adding one entry.
PROJECTION_NAMES: dict[str, tuple[str, ...]] = {
    "hf": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}
#: Module or parameter names of LoRA adapter matrices (PEFT: ``<proj>.lora_A.<adapter>``).
LORA_NAMES: tuple[str, ...] = ("lora_A", "lora_B")
#: Parameter names of a mixture of experts' fused expert matrices (Hugging Face Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS:
#: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``; DBRX keeps its experts
#: stacked in 2-D, ``ffn.experts.mlp.w1`` / ``v1`` / ``w2`` ``[E * I, H]``), each one component over all its experts,
#: frozen with its bias (``<name>_bias``) when it has one. A 2-D one counts inside a numbered block, under a module
#: named ``experts``.
EXPERT_NAMES: tuple[str, ...] = ("gate_up_proj", "down_proj", "up_proj", "gate_proj", "w1", "w2", "w3", "v1")

#: Parameter names of attention projections held as bare parameters of an attention module inside a numbered block
#: (Hugging Face XLNet: ``layer.3.rel_attn.q`` ``[d_model, heads, d_head]``, and ``k``, ``v``, ``o``, ``r``), each a
#: component of its own.
BARE_PROJECTION_NAMES: tuple[str, ...] = ("q", "k", "v", "o", "r", "qkv")

_ALL_PROJECTIONS = frozenset(n for names in PROJECTION_NAMES.values() for n in names)
_BLOCK_INDEX = re.compile(r"(^|\.)\d+(\.|$)")

Patterns = Optional[Union[str, Sequence[str]]]


@dataclass(frozen=True)
class Component:
    """One frozen-or-not unit: the matrix whose statistic decides, and every parameter frozen with it.

    Attributes:
        name: qualified name (a module name, or ``<module>.<param>`` for a LoRA parameter).
        weight: the matrix the statistic is computed on.
        params: the parameters frozen together (the module's own weight and bias).
    """

    name: str
    weight: nn.Parameter
    params: tuple[nn.Parameter, ...]


def _patterns(p: Patterns, argument: str) -> tuple[str, ...]:
    if p is None:
        return ()
    out = (p,) if isinstance(p, str) else tuple(p)
    for item in out:
        if not isinstance(item, str) or not item:
            raise TypeError(f"`{argument}` must be a string or a sequence of non-empty strings, got {item!r}.")
    return out


def _preview(names: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _own_params(module: nn.Module) -> tuple[nn.Parameter, ...]:
    return tuple(p for _, p in module.named_parameters(recurse=False))


def _bare_components(name: str, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(qualified name, parameter)`` of ``module``'s own parameters that are components: LoRA adapters (2-D and up),
    fused expert matrices (3-D, ``[experts, out, in]`` or ``[experts, in, out]``; 2-D, the experts stacked, under a
    module named ``experts`` inside a numbered block) and attention projections held as bare parameters inside a
    numbered block (:data:`BARE_PROJECTION_NAMES`, 2-D and up)."""
    in_block = _BLOCK_INDEX.search(name) is not None
    stacked = in_block and "experts" in name.split(".")
    return [(f"{name}.{pname}", p) for pname, p in module.named_parameters(recurse=False)
            if (pname in LORA_NAMES and p.dim() >= 2)
            or (pname in EXPERT_NAMES and (p.dim() == 3 or (stacked and p.dim() == 2)))
            or (in_block and pname in BARE_PROJECTION_NAMES and p.dim() >= 2)]


def uncovered_matrices(model: nn.Module, components: dict[str, Component]) -> list[str]:
    """The trainable parameters of two or more dimensions, held bare by modules inside numbered blocks, that no
    component holds (but biases, tables and positions by their names): what freezing every component leaves training
    (Mamba's ``A_log``, a bare matrix of a naming scheme not known here). Layers of the known kinds (Linear,
    convolutions, embeddings, attention) are left out: those that are no component (an output head numbered inside its
    own Sequential, a stem) are so by design."""
    held = {id(p) for c in components.values() for p in c.params}
    skip = ("bias", "embed", "table", "pos", "scale")
    known = _matrix_types() + (nn.Embedding, nn.MultiheadAttention)
    out = []
    for mname, module in model.named_modules():
        if isinstance(module, known) or not _BLOCK_INDEX.search(mname or ""):
            continue
        for pname, p in module.named_parameters(recurse=False):
            if (p.requires_grad and p.dim() >= 2 and id(p) not in held
                    and not any(word in pname.lower() for word in skip)):
                out.append(f"{mname}.{pname}")
    return out


def shared_outside(model: nn.Module, components: dict[str, Component]) -> dict[str, list[str]]:
    """Per component, the modules outside it that hold one of its parameters (the same ``nn.Parameter`` object: a
    weight tied by assignment, a hand-shared layer): freezing the component freezes the parameter there too, and their
    gradient adds to the component's statistic. Names as ``named_modules`` gives them first; a module reached by two
    paths (an alias, ``torch.compile``'s ``_orig_mod``) is one module. Components sharing nothing are left out."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for mname, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((mname, module))
    out: dict[str, list[str]] = {}
    for name, comp in components.items():
        try:
            own = model.get_submodule(name)
        except AttributeError:  # a bare parameter as the component (a LoRA factor): the module that holds it
            own = model.get_submodule(name.rpartition(".")[0])
        inside = {id(m) for m in own.modules()}
        others = dict.fromkeys(mname for p in comp.params for mname, m in holders.get(id(p), ())
                               if id(m) not in inside)
        if others:
            out[name] = list(others)
    return out


def _module_component(name: str, module: nn.Module) -> Optional[Component]:
    if isinstance(module, nn.MultiheadAttention):
        # the packed q/k/v input projection (its out_proj is a Linear of its own); separate q/k/v_proj_weight matrices
        # (kdim or vdim other than embed_dim) are selected with `include` on a module of their own, so are none here
        weight = module.in_proj_weight
        return None if weight is None else Component(name, weight, tuple(
            p for p in (weight, module.in_proj_bias) if p is not None))
    parametrized = _parametrized_weight(module)
    if parametrized is not None:
        return Component(name, parametrized[0], parametrized[1] + _own_params(module))
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or not any(weight is p for p in _own_params(module)):
        return None
    return Component(name, weight, _own_params(module))


def _parametrized_weight(module: nn.Module) -> Optional[tuple[nn.Parameter, tuple[nn.Parameter, ...]]]:
    """A weight under ``torch.nn.utils.parametrize`` (``orthogonal``, ``weight_norm``, a custom parametrization): the
    tensors it is computed from are the trainable ones, ``(largest, all of them)`` (``weight_norm``'s direction ``v``
    beside its magnitude ``g``), or ``None`` for a module without one."""
    container = getattr(module, "parametrizations", None)
    holder = getattr(container, "weight", None) if isinstance(container, nn.ModuleDict) else None
    if holder is None:
        return None
    originals = tuple(p for p in holder.parameters(recurse=False))
    if not originals:
        return None
    return max(originals, key=lambda p: p.numel()), originals


def _kind(module: nn.Module) -> type:
    """The module's class, not the classes derived from it by FSDP2's ``fully_shard`` (``FSDP<Class>``) and by
    ``torch.nn.utils.parametrize`` (one new class per module): a Sequential whose first layers were sharded one by
    one and whose last was left to the root's unit is still three Linears."""
    kind = type(module)
    unit = _fsdp_module_type()
    if unit is not None and issubclass(kind, unit) and kind is not unit:
        kind = next((b for b in kind.__bases__ if b is not unit), kind)
    return kind.__bases__[0] if getattr(module, "parametrizations", None) is not None and kind.__bases__ else kind


def _auto_match(name: str, module: nn.Module, component: Component, parent: Optional[nn.Module] = None,
                head: Optional[str] = None) -> bool:
    segments = name.split(".")
    if any(s in LORA_NAMES for s in segments):
        return component.weight.dim() >= 2
    if segments[-1] in _ALL_PROJECTIONS:
        return component.weight.dim() >= 2
    if isinstance(module, nn.MultiheadAttention) or isinstance(parent, nn.MultiheadAttention):
        # torch's attention (nn.TransformerEncoderLayer, torchvision's ViT): its input and output projections, in a
        # numbered block or not, as q/k/v_proj and o_proj are by name
        return component.weight.dim() >= 2
    # a weight matrix inside a repeated block (a child of a ModuleList or Sequential: a numeric name
    # segment): nn.Linear, Hugging Face Conv1D, a convolution (ResNet stages: `layer1.0.conv1`)
    if not isinstance(module, _matrix_types()) or not _BLOCK_INDEX.search(name):
        return False
    if segments[-1].isdigit() and not _BLOCK_INDEX.search(".".join(segments[:-1])) and parent is not None:
        # numbered only as a child of a Sequential: the output head's (`head`, the Sequential holding the model's last
        # matrix layer: MobileNetV3's `classifier = Sequential(Linear, Hardswish, Dropout, Linear)`) is no repeated
        # block, nor one with no other layer of its kind (HF ResNet's `classifier = Sequential(Flatten(), Linear)`)
        if head is not None and ".".join(segments[:-1]) == head:
            return False
        return sum(_kind(child) is _kind(module) for child in parent.children()) > 1
    return True


def _has_twin(named: list[tuple[str, nn.Module]], head: str, layer: type) -> bool:
    """Whether a module outside the container ``head`` (and not above it) is a container of its type holding a layer
    of type ``layer`` as a direct child: the image tower of a CLIP-style model beside its text tower, an autoencoder's
    encoder beside its decoder. An output head has no twin (MobileNetV3's ``classifier`` beside ``features``, a
    Sequential of blocks). A container inside a numbered block (a transformer block's ``blocks.3.mlp =
    Sequential(Linear, GELU, Linear)``) is part of the blocks, not a second tower: counted, it made a ViT's
    ``head = Sequential(Linear, Tanh, Dropout, Linear)`` two components that froze."""
    kind = _kind(dict(named)[head])
    return any(_kind(m) is kind and n != head and not n.startswith(head + ".") and not head.startswith(n + ".")
               and not _BLOCK_INDEX.search(n)
               and any(_kind(c) is layer for c in m.children()) for n, m in named)


def _matrix_types() -> tuple[type[nn.Module], ...]:
    return linear_types() + (nn.modules.conv._ConvNd,)


def find_components(
    model: nn.Module,
    include: Patterns = None,
    exclude: Patterns = None,
    trainable_only: bool = True,
    owner: str = "GradientEarlyStopping",
    allow_empty: bool = False,
) -> dict[str, Component]:
    """The components of ``model``, by qualified name, in ``named_modules`` order.

    Without ``include``, components are found by name: projections of every naming scheme in
    :data:`PROJECTION_NAMES` (HF ``q_proj`` ... ``down_proj``; GPT-2 ``c_attn``/``c_proj``/``c_fc``, also
    its ``Conv1D``), LoRA adapters (modules or 2-D parameters named ``lora_A``/``lora_B``),
    ``nn.MultiheadAttention``'s packed input projection (named as the attention module) and its ``out_proj``, a
    mixture of experts' fused 3-D expert matrices (:data:`EXPERT_NAMES`, one component each over all experts), and any
    ``nn.Linear``, Hugging Face ``Conv1D`` or convolution inside a repeated block (a name with a numeric
    segment such as ``blocks.3`` or ResNet's ``layer1.0.conv1``). Embeddings, norms and an output head or
    stem outside the blocks are not components. The statistics are element-wise means, so a
    ``Conv1D``'s transposed layout and a convolution's kernel need nothing special. With ``include``
    (fnmatch globs on module names), exactly the matching modules that own a ``weight`` are
    components, whatever their type (so an embedding or the head can be asked for).

    Args:
        include: glob patterns selecting components explicitly instead of the naming schemes.
        exclude: glob patterns removed from the result.
        trainable_only: keep only components whose weight requires a gradient (e.g. not the frozen
            base weights of a LoRA model).
        allow_empty: return an empty dict when nothing is found instead of raising (the reason is
            :func:`no_component_reason`).

    Raises:
        ValueError: a pattern matches no module, or no component is found (the message lists the
            module names seen and how to select components).
    """
    inc = _patterns(include, "include")
    exc = _patterns(exclude, "exclude")
    named = [(n, m) for n, m in model.named_modules() if n]
    names = [n for n, _ in named]
    # LoRA adapters and a mixture of experts' fused expert matrices held as bare parameters (`<module>.lora_A`,
    # `<module>.experts.down_proj`): components of their own, named like parameters, which `include` / `exclude`
    # select by that name too (the names the monitor reports)
    bare = {name: _bare_components(name, module) for name, module in named}
    selectable = names + [full for params in bare.values() for full, _ in params]
    for argument, pats in (("include", inc), ("exclude", exc)):
        for pat in pats:
            if not any(fnmatchcase(n, pat) for n in selectable):
                raise ValueError(
                    f"{owner}: `{argument}` pattern {pat!r} matches no module of {type(model).__name__}. "
                    f"Module names are: {_preview(names)}."
                )
    found: dict[str, Component] = {}
    modules = {"": model, **dict(named)}
    # the output head's Sequential: the parent of the last matrix layer registered, when that layer is numbered only as
    # its child and other matrix layers lie outside it (a plain MLP's layers, all in one Sequential, stay components)
    last = next((n for n, m in reversed(named) if isinstance(m, _matrix_types())), None)
    head = None
    if last is not None:
        *above, tail = last.split(".")
        if above and tail.isdigit() and not _BLOCK_INDEX.search(".".join(above)):
            head = ".".join(above)
            if not any(isinstance(m, _matrix_types()) and not n.startswith(head + ".") for n, m in named):
                head = None  # the whole model is that Sequential (an MLP): its layers are the blocks
            elif _has_twin(named, head, _kind(modules[last])):
                head = None  # one of two towers (a dual encoder's, an autoencoder's decoder): no output head
    for name, module in named:
        if any(fnmatchcase(name, p) for p in exc):
            continue
        comp = _module_component(name, module)
        if inc:
            if any(fnmatchcase(name, p) for p in inc):
                if comp is None and any(name == p for p in inc):
                    raise ValueError(
                        f"{owner}: `include` names {name!r}, a {type(module).__name__} without a `weight` "
                        "parameter of its own; name the module that owns the matrix."
                    )
                if comp is not None:
                    found[name] = comp
        elif comp is not None and _auto_match(name, module, comp, modules.get(name.rpartition(".")[0]), head):
            found[name] = comp
        for full, p in bare[name]:
            if not any(fnmatchcase(full, e) for e in exc) and (not inc or any(fnmatchcase(full, i) for i in inc)):
                bias = getattr(module, full.rpartition(".")[2] + "_bias", None)
                found[full] = Component(full, p, (p,) if not isinstance(bias, nn.Parameter) else (p, bias))
    if trainable_only:
        found = {n: c for n, c in found.items() if c.weight.requires_grad}
    if not found and not allow_empty:
        raise ValueError(f"{owner}: {no_component_reason(model, include)}")
    return found


def no_component_reason(model: nn.Module, include: Patterns = None) -> str:
    """Why :func:`find_components` found no trainable component in ``model``."""
    names = [n for n, _ in model.named_modules() if n]
    how = "`include` patterns" if _patterns(include, "include") else (
        "the naming schemes (q_proj/k_proj/v_proj/o_proj, gate_proj/up_proj/down_proj, c_attn/c_proj/c_fc, "
        "lora_A/lora_B, nn.MultiheadAttention, fused expert tensors, nn.Linear, Conv1D or convolutions inside numbered blocks)"
    )
    return (
        f"no trainable component of {type(model).__name__} matches {how}. Pass `include=[...]` glob patterns "
        f"naming the modules to watch (e.g. 'layers.*.attn.*'). Module names seen: {_preview(names)}."
    )


# --------------------------------------------------------------------------- statistics


def _l1_norms(tensors: list[Tensor]) -> Tensor:
    # accumulated in float32 (a bf16 model's gradients summed in bf16 were off by up to 0.4%)
    return torch.stack(foreach_norm(tensors, 1, dtype=torch.float32))


def mean_abs(tensors: Sequence[Tensor]) -> Tensor:
    """``[mean_ij |T_ij| for T in tensors]`` as one float32 vector (one fused L1 reduction).

    With ``T = W.grad`` this is the paper's statistic (element-wise L1 norm of the gradient, per
    element). Stays on the tensors' device.
    """
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return torch.zeros(0)
    numel = torch.tensor([t.numel() for t in tensors], dtype=torch.float32, device=tensors[0].device)
    return _l1_norms(tensors) / numel


def mean_abs_update(current: Sequence[Tensor], previous: Sequence[Tensor], steps: int = 1) -> Tensor:
    """``[mean_ij |W_ij - P_ij| / steps]``: the weight change per element and per optimizer step since a
    snapshot ``P`` taken ``steps`` steps ago (the released GradES code's statistic, per element)."""
    if len(current) != len(previous):
        raise ValueError(f"`current` and `previous` differ in length: {len(current)} != {len(previous)}.")
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1, got {steps}.")
    if not current:
        return torch.zeros(0)
    diffs = foreach_sub([c.detach() for c in current], [p.detach() for p in previous])
    return mean_abs(diffs) / steps


def relative_ratio(stat: Tensor, reference: Tensor) -> Tensor:
    """``stat / reference`` where ``reference > 0``; where ``reference == 0`` (a component that never
    moved), ``0`` if ``stat == 0`` else ``inf``; NaN where the reference is NaN (not taken yet), so that
    such a component never freezes."""
    ref_ok = reference > 0
    safe = torch.where(ref_ok, reference, torch.ones_like(reference))
    fallback = torch.where(stat == 0, torch.zeros_like(stat), torch.full_like(stat, float("inf")))
    fallback = torch.where(torch.isnan(reference), torch.full_like(stat, float("nan")), fallback)
    return torch.where(ref_ok, stat / safe, fallback)


def freeze_mask(stat: Tensor, reference: Optional[Tensor], tau: float) -> Tensor:
    """Components to freeze: ``stat < tau * reference`` (relative rule) or ``stat < tau`` when
    ``reference`` is ``None`` (absolute rule). Non-finite statistics never freeze."""
    value = stat if reference is None else relative_ratio(stat, reference)
    return torch.isfinite(stat) & (value < tau)


def ema_update(previous: Optional[Tensor], value: Tensor, smoothing: float) -> Tensor:
    """Exponential moving average ``smoothing * previous + (1 - smoothing) * value``; ``value`` when
    there is no previous value or ``smoothing == 0``."""
    if previous is None or smoothing == 0.0:
        return value
    return previous * smoothing + value * (1.0 - smoothing)


def freeze_parameters(params: Iterable[nn.Parameter], optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
    """Freeze ``params`` for good: ``requires_grad=False``, ``.grad`` dropped, optimizer state freed.

    The parameters stay in their optimizer's param groups (so that the optimizer's ``state_dict``
    keeps its layout); optimizers skip parameters without a gradient. ``torch.optim.LBFGS`` does not:
    it moves every parameter along a direction built from its history, so that history is restarted
    (see :func:`_restart_lbfgs`). Returns the number of elements frozen.
    """
    params = list(params)
    ids = {id(p) for p in params}
    count = 0
    for p in params:
        p.requires_grad_(False)
        p.grad = None
        count += p.numel()
    for opt in optimizers:
        if isinstance(opt, torch.optim.LBFGS):
            _restart_lbfgs(opt)  # its one state entry (on its first parameter) is the whole history: kept, emptied
            continue
        for p in [q for q in opt.state if id(q) in ids]:
            del opt.state[p]
    return count


def _restart_lbfgs(opt: torch.optim.LBFGS) -> None:
    """Empty an LBFGS optimizer's history, in place, as before its first iteration.

    LBFGS updates every parameter along a direction built from its past steps and gradient changes, kept
    in the state of its first parameter, and reads a missing gradient as zero: a frozen matrix still
    moved (by 0.018 seven steps after its freeze). Once the history is empty the next direction is minus
    the gradient, zero on the frozen parameters, and so are every later step and gradient change, hence
    every later direction: the frozen parameters stay bitwise as they are. Emptied in place (not
    replaced): a freeze in the first closure evaluation of a step (``on_before_optimizer_step``) comes
    before LBFGS reads its history for that step from the dict it already holds, so the step under way
    restarts too. The price: LBFGS forgets its curvature estimate at each freeze."""
    params = opt.param_groups[0]["params"] if opt.param_groups else []
    if not params or params[0] not in opt.state:
        return  # no step taken yet: nothing remembered
    state = opt.state[params[0]]
    kept = {"func_evals": state.get("func_evals", 0), "n_iter": 0}  # n_iter 0: the next iteration is a first one
    state.clear()
    state.update(kept)


# --------------------------------------------------------------------------- frozen prefix


@dataclass(frozen=True)
class PrefixCut:
    """Where the backward can stop: the leading blocks whose weight matrices are all frozen.

    Attributes:
        depth: the number ``k`` of leading blocks whose weight matrices (parameters of two or more
            dimensions) are all frozen; the backward can stop at the end of block ``k - 1``.
        params: the parameters of those blocks that still require a gradient (norm scales and shifts,
            biases outside the components), by qualified name: freezing them cuts the backward there.
        front: qualified names of the trainable parameters in front of the blocks (embeddings): while
            any is trainable, the backward has to run through the blocks to reach it.
    """

    depth: int
    params: dict[str, nn.Parameter]
    front: tuple[str, ...]


def _block_path(name: str) -> Optional[tuple[str, str]]:
    """``(container, index)`` of the first numeric segment of a qualified name, or ``None``."""
    segments = name.split(".")
    for i, segment in enumerate(segments):
        if segment.isdigit():
            return ".".join(segments[:i]), segment
    return None


def block_container(model: nn.Module, names: Iterable[str]) -> Optional[str]:
    """The qualified name of the one ``nn.ModuleList`` or ``nn.Sequential`` whose numbered children (the
    blocks) hold every component in ``names`` (``blocks`` for ``blocks.0.attn.q_proj``, ``model.layers``
    for Hugging Face ``model.layers.0.self_attn.q_proj``, ``transformer.h`` for GPT-2), or ``None`` when
    the components are not all under the numbered children of one such container (a component outside
    the blocks, an encoder and a decoder, a ResNet's several stages). ``""`` is the model itself.

    Example:
        >>> blocks = nn.ModuleList(nn.ModuleDict({"q_proj": nn.Linear(4, 4)}) for _ in range(2))
        >>> block_container(nn.ModuleDict({"blocks": blocks}), ["blocks.0.q_proj", "blocks.1.q_proj"])
        'blocks'
    """
    containers = set()
    for name in names:
        path = _block_path(name)
        if path is None:
            return None
        containers.add(path[0])
    if len(containers) != 1:
        return None
    container = containers.pop()
    try:
        module = model.get_submodule(container)
    except AttributeError:
        return None
    return container if isinstance(module, (nn.ModuleList, nn.Sequential)) else None


def frozen_prefix(model: nn.Module, container: str) -> PrefixCut:
    """The leading blocks of ``container`` (see :func:`block_container`) whose weight matrices are all
    frozen, what is left to freeze in them, and what trains in front of them.

    A block counts when every parameter of it with two or more dimensions has ``requires_grad=False``
    and none of its trainable parameters is shared with a module outside the leading blocks; blocks
    are taken in the container's order and the first that does not count ends the prefix. The *front*
    is every parameter that ``model.named_parameters()`` lists before the container's first one
    (embeddings, a ViT's class token and position embedding), the modules registered before the blocks.

    Freezing :attr:`PrefixCut.params` when :attr:`PrefixCut.front` is empty leaves no tensor before the
    end of the prefix that requires a gradient, so autograd records no graph there and the backward
    stops at the end of the prefix; the gradients of every parameter still trainable are unchanged.
    """
    blocks = model.get_submodule(container)
    base = f"{container}." if container else ""
    named = list(model.named_parameters())
    first = next((i for i, (n, _) in enumerate(named) if n.startswith(base)), len(named))
    front = tuple(n for n, p in named[:first] if p.requires_grad)
    names_of: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(n)
    depth = 0
    params: dict[str, nn.Parameter] = {}
    prefixes: list[str] = []
    for child, block in blocks.named_children():
        prefix = f"{base}{child}."
        own = [(f"{prefix}{n}", p) for n, p in block.named_parameters()]
        if any(p.requires_grad and p.dim() >= 2 for _, p in own):
            break
        inside = prefixes + [prefix]
        shared = any(
            not any(m.startswith(q) for q in inside) for _, p in own if p.requires_grad for m in names_of[id(p)]
        )
        if shared:
            break
        prefixes.append(prefix)
        depth += 1
        params.update((n, p) for n, p in own if p.requires_grad)
    return PrefixCut(depth, params, front)
