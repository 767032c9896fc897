"""The one rule that picks how a Linear-form layer (``nn.Linear``, ``nn.Conv2d`` on unfolded patches)
gets its per-example weight-gradient norms: :meth:`LinearRule.choose`.

With ``A_i`` ``(T, d_in)`` and ``D_i`` ``(T, d_out)`` one example's inputs and output gradients
(``T > 1``; ``T = 1`` always uses ``||a_i||^2 ||d_i||^2``), the per-example weight gradient is
``G_i = D_i^T A_i`` and there are two ways to its norm:

* a *materialising* path forms each ``G_i`` (``d_in d_out`` floats per example). ``"fused"`` (plain
  ``nn.Linear`` only) does it inside the layer's backward, which then returns ``sum_i G_i`` as the
  weight gradient: the same multiply-adds as the plain backward, plus a norm and a sum pass over each
  ``G_i``; on CPU a chunk of examples at a time (:func:`examples_at_once`). ``"materialize"`` does it
  beside the plain backward: ``B T d_in d_out`` extra multiply-adds, the whole batch at once.
* ``"gram"``: ``||G_i||_F^2 = <A_i A_i^T, D_i D_i^T>_F``, ``B T^2 (d_in + d_out)`` extra multiply-adds
  and no ``d_in x d_out`` buffer.

``"auto"`` uses the layer's materialising path (fused if it can, else materialize) unless

* **memory rule**: the per-example gradients it holds at once do not fit the cap,
  ``4 * groups * d_in * d_out * n > max_bytes`` (fp32 bytes; ``n`` = :func:`examples_at_once` for the
  fused path: a :data:`CPU_CHUNK_BYTES` chunk on CPU, at least one example, the batch elsewhere;
  ``n = B`` for materialize), or
* **cost rule**: Gram is cheaper, ``T^2 (d_in + d_out) < w * d_in * d_out``, where ``w`` is the
  materialising path's extra work per element of ``G_i`` in multiply-adds: ``w = T`` for materialize
  (its extra matmul), ``w =`` :data:`GRAM_OVER_FUSED` ``= 8`` for fused (its memory passes, measured:
  ``benchmarks/bench_noise_scale.py --crossover``; short sequences, wide layers),

and then uses ``"gram"``. An explicit ``"gram"`` or ``"materialize"`` is used as is; an explicit
``"fused"`` is used as is on a layer that can fuse, and is ``"auto"`` on one that cannot.

The two tunables live on the package, ``lightning_monitor.probes.per_example.CPU_CHUNK_BYTES`` and
``.GRAM_OVER_FUSED``, and are read at call time (tests and benchmarks set them there).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal, Optional

__all__ = ["LinearRule", "LinearStrategy", "examples_at_once"]

LinearStrategy = Literal["auto", "fused", "gram", "materialize"]
STRATEGIES: tuple[str, ...] = ("auto", "fused", "gram", "materialize")


def _knob(name: str) -> int:
    return getattr(sys.modules[__package__], name)


def examples_at_once(device_type: str, batch: int, per_example_bytes: int) -> int:
    """Examples whose per-example gradients the fused path forms at once: on CPU as many as fit
    :data:`CPU_CHUNK_BYTES` (the L2 cache of one core), at least one; elsewhere the whole batch."""
    if device_type != "cpu":
        return batch
    return max(1, min(batch, _knob("CPU_CHUNK_BYTES") // max(per_example_bytes, 1)))


@dataclass(frozen=True)
class LinearRule:
    """The requested strategy and the memory cap; :meth:`choose` applies the module docstring's rule.

    ``max_bytes=None``: no memory cap (the cost rule alone).
    """

    strategy: str = "auto"
    max_bytes: Optional[int] = None

    def choose(self, *, t: int, d_in: int, d_out: int, batch: int, device_type: str,
               fused: bool = False, groups: int = 1, held_examples: Optional[int] = None) -> str:
        """``"fused"``, ``"gram"`` or ``"materialize"`` for a layer of ``groups`` blocks ``d_in -> d_out``
        on ``batch`` examples of ``t`` positions; ``fused``: whether the layer can take the fused path;
        ``held_examples``: how many examples' gradients that path holds at once (default: a CPU chunk
        for the fused path, the batch otherwise)."""
        if self.strategy in ("gram", "materialize"):
            return self.strategy
        if self.strategy == "fused" and fused:
            return "fused"
        path = "fused" if fused else "materialize"
        per = 4 * groups * d_in * d_out  # one example's weight gradient, fp32
        if held_examples is None:
            held_examples = examples_at_once(device_type, batch, per) if fused else batch
        held = per * held_examples
        if self.max_bytes is not None and held > self.max_bytes:
            return "gram"
        w = _knob("GRAM_OVER_FUSED") if fused else t
        return "gram" if t * t * (d_in + d_out) < w * d_in * d_out else path
