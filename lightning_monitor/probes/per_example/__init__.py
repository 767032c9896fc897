"""Exact per-example squared gradient norms, computed inside the ordinary backward pass.

While a :class:`PerExampleGradNorms` context is active, a forward hook on every covered module keeps a
reference to the module's input (autograd saves it anyway) and hooks the module's output gradient. When
the backward pass reaches that output, the handler of the module's type turns (input, output gradient)
into the squared norm of each example's gradient for each of the module's parameters, in fp32
(Goodfellow, "Efficient per-example gradient computations", arXiv 1510.01799).

Layout (one file per module type, as opacus' grad samplers; a dispatch table as BackPACK's):

* :mod:`.registry`: :class:`Handler`, the table :data:`HANDLERS` and the decorator :func:`register`;
* :mod:`.linear` (``nn.Linear``, with the fused path; Hugging Face ``Conv1D``), :mod:`.attention`
  (``nn.MultiheadAttention``'s packed input projection, and its ``out_proj`` called), :mod:`.embedding`
  (``nn.Embedding``), :mod:`.norm` (``nn.LayerNorm``, ``nn.RMSNorm``, Hugging Face Llama-style RMSNorm,
  ``nn.GroupNorm``; ``nn.BatchNorm*`` refused with its reason), :mod:`.conv` (``nn.Conv2d``,
  ``nn.Conv1d``): the handlers;
* :mod:`.strategy`: the one rule (cost and memory) choosing fused / Gram / materialised for
  Linear-form layers; :mod:`.kernels`: the Linear-form math shared by Linear and Conv2d;
* :mod:`.probe`: :class:`PerExampleGradNorms` (hooks, shared parameters, coverage verification).

Covering a new module type is a new file with a ``@register(MyModule)`` :class:`Handler` subclass,
imported before the probe is built (a type of an optional library by name: :func:`register_by_name`).
Parameters that no handler covers (``nn.MultiheadAttention``'s cross-attention input projection, ``nn.BatchNorm*``
and what feeds it in training mode, custom modules, an Embedding with ``scale_grad_by_freq``), and those of
modules whose input has no separable batch
dimension (positions broadcast over the batch, found by the probe, see :class:`PerExampleGradNorms`),
are listed in :attr:`PerExampleGradNorms.uncovered` with the reason in
:attr:`PerExampleGradNorms.reasons`, never silently mixed in. A parameter used more than once in one
forward (a module called twice, tied weights) gets its per-example gradients materialised and summed over
its uses before the norm, so the cross terms are exact.

With ``loss_reduction="mean"`` (a loss averaged over the batch, e.g. cross-entropy over ``B x T``
tokens) the hooks see ``g_i / B``; the norms are rescaled by ``B``, so the per-example loss is ``B`` times
the example's share of the batch loss: its mean over its tokens when every example counts the same number of
tokens, else ``B n_i / N`` times that mean (``n_i`` of the batch's ``N`` counted tokens: labels padded with
``-100`` to different lengths). That is the definition the noise scale needs (the batch gradient is the mean
of these per-example gradients).
"""

from __future__ import annotations

#: On CPU the fused Linear forms its per-example weight gradients a chunk of examples at a time, into a
#: buffer of about this size (the L2 cache of one core), and reduces them to their norms and their sum
#: while still in cache: the sum and norm passes then cost almost nothing and the transient memory is
#: one chunk. Elsewhere (GPU) the whole batch is one batched matmul. Read at call time: set it here.
CPU_CHUNK_BYTES = 1 << 20

#: ``"auto"`` prefers the Gram form to the fused Linear when ``T^2 (d_in + d_out) < GRAM_OVER_FUSED d_in d_out``
#: (:class:`~.strategy.LinearRule`). The fused path adds a few memory passes over each example's
#: ``d_in x d_out`` gradient (and its matmuls run at inner size ``T``), the Gram form ``T^2 (d_in + d_out)``
#: multiply-adds per example; measured on CPU (one thread, B=8, d from 256 to 1024, T from 2 to 128) the
#: two cost the same near a ratio of 8: e.g. T=48, 1024x1024 (ratio 4.5): Gram 1.05x, fused 1.10x a plain
#: step; T=128, 256x1024 (ratio 80): Gram 1.25x, fused 1.06x. Read at call time: set it here.
GRAM_OVER_FUSED = 8

# the handler files register themselves on import
from lightning_monitor.probes.per_example import attention, conv, embedding, linear, norm, recurrent  # noqa: F401
from lightning_monitor.probes.per_example.kernels import (
    linear_sq_norms,
    per_example_linear,
    project_matrix,
)
from lightning_monitor.probes.per_example.probe import PerExampleGradNorms
from lightning_monitor.probes.per_example.registry import (
    HANDLERS,
    HANDLERS_BY_NAME,
    Handler,
    handler_for,
    register,
    register_by_name,
)
from lightning_monitor.probes.per_example.strategy import LinearRule, LinearStrategy

__all__ = [
    "CPU_CHUNK_BYTES",
    "GRAM_OVER_FUSED",
    "HANDLERS",
    "HANDLERS_BY_NAME",
    "Handler",
    "LinearRule",
    "LinearStrategy",
    "PerExampleGradNorms",
    "handler_for",
    "linear_sq_norms",
    "per_example_linear",
    "project_matrix",
    "register",
    "register_by_name",
]
