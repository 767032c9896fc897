"""Capture a bounded random subsample of the input rows of chosen layers, on demand.

:class:`InputCapture` installs nothing until :meth:`InputCapture.arm` is called (on a monitored step
only). Each armed layer then records, on its forward call, at most ``max_rows`` rows of its
input ``x[..., in_features]`` (all leading dimensions flattened: batch, sequence, ...; for an ``nn.Conv2d``
its input patches, the rows its weight ``[C_out, C_in * kh * kw]`` multiplies), picked at random
without replacement, detached, in their own dtype and on their own device. A layer called several times in the
step (a layer shared across the time steps of a recurrence or across the blocks of a model, siamese towers, the
micro-batches of gradient accumulation) gives a sample of the rows of all its calls together, each row as likely as
any other. Not read: recomputations inside a backward (activation checkpointing: rows the forward gave already),
and calls on the identity matrix and on what such a call returned (PEFT's DoRA runs its adapters on the identity,
``lora_B(lora_A(eye))``, for its weight norm, before the data). :meth:`InputCapture.take` hands the rows over,
removes the hooks and forgets them.

The random rows come from the capture's own generator: arming does not touch the global RNG, so a
run with the monitor draws the same dropout masks and batches as a run without it.

With :attr:`InputCapture.row_mask` set (a ``(B, T)`` mask of the positions that hold a token: a batch's
``attention_mask``), an input whose two leading dimensions are ``(B, T)`` (or ``(T, B)``) gives rows of the masked
positions only: padding positions, one embedding repeated, are no rows of the layer's. The draw stays on the device
(no count of the mask is read): where fewer positions than ``max_rows`` hold a token, the sample is padded with rows
of NaN, which carry no alignment.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_monitor.probes import call_args, in_backward, in_dry_run

__all__ = ["InputCapture"]


class InputCapture:
    """Forward pre-hooks that sample the inputs of ``modules`` on the steps they are armed.

    Args:
        modules: ``name -> module``; each module's first positional input is captured.
        max_rows: at most this many rows per module and armed step (>= 1).
        seed: seed of the capture's own random generator (one per device).
    """

    def __init__(self, modules: Mapping[str, nn.Module], max_rows: int = 256, seed: int = 0) -> None:
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"`max_rows` must be an integer >= 1, got {max_rows!r}.")
        self.modules = dict(modules)
        self.max_rows = max_rows
        self.seed = seed
        self._handles: dict[str, list[RemovableHandle]] = {}
        # per layer, the samples of its calls of the step not merged yet: (rows, the rows of the calls they sample, the
        # random keys the rows were drawn by where a row mask chose them, else None; see _merge)
        self._captured: dict[str, list[tuple[Tensor, int, Optional[Tensor]]]] = {}
        self._held: dict[str, int] = {}  # rows those samples hold, per layer
        # outputs of calls on the identity this step (their consumers are on the identity's path too), and the layers
        # whose running call is one
        self._identity_outputs: list[Tensor] = []
        self._on_identity: set[str] = set()
        self._generators: dict[torch.device, torch.Generator] = {}
        #: while set, calls are not read (the validation loop, run between the micro-batches of an armed step)
        self.paused = False
        #: ``(B, T)`` bool, the positions of the current batch that hold a token (see the module docstring), or None
        self.row_mask: Optional[Tensor] = None

    @property
    def armed(self) -> bool:
        """Whether any hook is installed now."""
        return bool(self._handles)

    def arm(self, names: Optional[Iterable[str]] = None) -> None:
        """Install the hooks on every module (or those of ``names``) that has not captured yet (idempotent); they
        read every call until :meth:`take`."""
        for name in self.modules if names is None else names:
            if name in self._handles or name in self._captured:
                continue
            module = self.modules[name]
            self._handles[name] = [module.register_forward_pre_hook(self._make_hook(name), with_kwargs=True),
                                   module.register_forward_hook(self._make_post_hook(name))]

    def disarm(self) -> None:
        """Remove every hook still installed."""
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()
        self._identity_outputs, self._on_identity = [], set()

    def take(self) -> dict[str, Tensor]:
        """The rows captured since :meth:`arm` (``name -> (rows, in)``; layers that did not run are
        absent); removes the remaining hooks and drops the capture's references."""
        self.disarm()
        self.row_mask = None
        parts, self._captured, self._held = self._captured, {}, {}
        return {name: self._merge(kept)[0] for name, kept in parts.items()}

    def release(self) -> None:
        """Forget everything captured and remove every hook."""
        self.disarm()
        self._captured, self._held = {}, {}
        self.paused = False
        self.row_mask = None

    # ------------------------------------------------------------------ internals
    def _disarm(self, name: str) -> None:
        for handle in self._handles.pop(name, ()):
            handle.remove()

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def _make_hook(self, name: str) -> Any:
        @torch.compiler.disable  # eager under torch.compile: traced, it recompiled per layer (its name, its state)
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if in_dry_run() or self.paused:  # another monitor's run of the module on a batch of its own; validation
                return
            args = call_args(args, kwargs, module)
            if not args or not isinstance(args[0], Tensor):
                self._disarm(name)
                return
            x = args[0]
            if in_backward():
                return  # a recomputation by activation checkpointing: the forward read these rows already
            self._on_identity.discard(name)  # left by a call on the identity that raised (its post hook did not run)
            if any(x is t for t in self._identity_outputs) or _is_identity(module, x):
                self._on_identity.add(name)  # its output is on the identity's path too (see the post hook)
                return
            keys: Optional[Tensor] = None
            if isinstance(module, nn.Conv2d):
                rows, n = self.sample_patches(module, x, counted=True)
            else:
                mask = self._mask_for(x)
                rows, keys = self._sample_masked(x, mask) if mask is not None else (self.sample(x), None)
                n = x.numel() // x.shape[-1] if x.shape[-1] else 0
            self._keep(name, rows, n, keys)

        return hook

    def _make_post_hook(self, name: str) -> Any:
        @torch.compiler.disable
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if name in self._on_identity:
                self._on_identity.discard(name)
                if isinstance(output, Tensor):
                    self._identity_outputs.append(output)

        return hook

    def _keep(self, name: str, rows: Tensor, n: int, keys: Optional[Tensor] = None) -> None:
        """Add a call's sample ``rows`` (at most ``max_rows`` of its ``n`` rows, uniformly) to the layer's samples of the
        step, merged into one when they hold more than eight times ``max_rows`` rows (and at :meth:`take`)."""
        parts = self._captured.setdefault(name, [])
        parts.append((rows, n, keys))
        held = self._held.get(name, 0) + rows.shape[0]
        if len(parts) > 1 and held > 8 * self.max_rows:
            merged = self._merge(parts)
            self._captured[name], held = [merged], merged[0].shape[0]
        self._held[name] = held

    def _merge(self, parts: list[tuple[Tensor, int, Optional[Tensor]]]) -> tuple[Tensor, int, Optional[Tensor]]:
        """One uniform sample of at most ``max_rows`` of all the rows the ``parts`` sample: ``max_rows`` positions are
        drawn among all those rows, and each part gives as many of its rows, at random, as positions fell in it (the
        counts of a sample of the whole, hypergeometric), so every row of every call is as likely as any other."""
        if len(parts) == 1:
            return parts[0]
        total = sum(n for _, n, _ in parts)
        first = parts[0][0]
        if all(k is not None for _, _, k in parts):
            # rows a row mask chose (the micro-batches of an accumulated step, each padded its own way): each part holds
            # its rows of the smallest random keys, the padding's beyond every token's, so the smallest keys of them all
            # are a uniform sample of every call's tokens (weighed by positions, a padded call's tokens were drawn more)
            rows = torch.cat([r.to(device=first.device, dtype=first.dtype) for r, _, _ in parts])
            keys = torch.cat([k.to(first.device) for _, _, k in parts])
            if rows.shape[0] > self.max_rows:
                idx = keys.topk(self.max_rows, largest=False).indices
                rows, keys = rows.index_select(0, idx), keys.index_select(0, idx)
            return rows, total, keys
        if sum(r.shape[0] for r, _, _ in parts) <= self.max_rows and all(r.shape[0] == n for r, n, _ in parts):
            return torch.cat([r.to(device=first.device, dtype=first.dtype) for r, _, _ in parts]), total, None
        cpu = self._generator(torch.device("cpu"))
        draw = random.Random(int(torch.randint(0, 2**62, (1,), generator=cpu)))
        bounds = list(itertools.accumulate(n for _, n, _ in parts))
        counts = [0] * len(parts)
        for i in draw.sample(range(total), min(self.max_rows, total)):
            counts[bisect.bisect_right(bounds, i)] += 1
        taken = []
        for (rows, _, _), c in zip(parts, counts):
            if c:
                gen = self._generator(rows.device)
                idx = torch.randperm(rows.shape[0], generator=gen, device=rows.device)[:c]
                taken.append(rows.index_select(0, idx).to(device=first.device, dtype=first.dtype))
        return torch.cat(taken), total, None

    def _mask_for(self, x: Tensor) -> Optional[Tensor]:
        """:attr:`row_mask` laid out as ``x``'s rows (flattened), where ``x``'s leading dimensions are the mask's
        ``(B, T)`` (batch first, as Hugging Face's models) or ``(T, B)`` (``nn.MultiheadAttention`` without
        ``batch_first``); else ``None``: every row counts."""
        mask = self.row_mask
        if mask is None or x.dim() < 3 or x.shape[-1] == 0:
            return None
        lead = tuple(x.shape[:2])
        if lead == tuple(mask.shape):
            laid = mask
        elif lead == tuple(mask.shape[::-1]):
            laid = mask.t()
        else:
            return None
        rest = x.numel() // (x.shape[0] * x.shape[1] * x.shape[-1])  # dimensions between (B, T) and the features
        laid = laid.to(x.device).reshape(*lead, *([1] * (x.dim() - 3)))
        return laid.expand(*x.shape[:-1]).reshape(-1) if rest > 1 else laid.reshape(-1)

    def _sample_masked(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """At most ``max_rows`` random rows of ``x`` flattened to ``(-1, x.shape[-1])`` among those ``mask`` (bool, one
        entry per row) marks, detached (a row it does not mark, where fewer are marked than ``max_rows``, is NaN), and
        the random keys they were drawn by: uniform for a marked row, 2 for another. Drawn on the device: the rows of
        the smallest keys (no count of the mask read)."""
        with torch.no_grad():
            rows = x.detach().reshape(-1, x.shape[-1])
            n = rows.shape[0]
            keys = torch.rand(n, generator=self._generator(rows.device), device=rows.device).masked_fill(~mask, 2.0)
            if n > self.max_rows:
                idx = keys.topk(self.max_rows, largest=False).indices
                rows, keys, mask = rows.index_select(0, idx), keys.index_select(0, idx), mask.index_select(0, idx)
            else:
                rows = rows.clone()
            if rows.is_floating_point():
                rows = torch.where(mask[:, None], rows, torch.full_like(rows, float("nan")))
            return rows, keys

    def sample(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """At most ``max_rows`` random rows of ``x`` flattened to ``(-1, x.shape[-1])``, detached; with ``mask``
        (bool, one entry per row), of the rows it marks (see :meth:`_sample_masked`)."""
        if mask is not None:
            return self._sample_masked(x, mask)[0]
        with torch.no_grad():
            rows = x.detach().reshape(-1, x.shape[-1])
            n = rows.shape[0]
            if n > self.max_rows:
                idx = torch.randperm(n, generator=self._generator(rows.device), device=rows.device)[: self.max_rows]
                rows = rows.index_select(0, idx)
            else:
                rows = rows.clone()
        return rows

    def sample_patches(self, conv: nn.Conv2d, x: Tensor, counted: bool = False) -> Any:
        """At most ``max_rows`` random input patches of ``conv`` (rows of its unfolded input,
        ``(rows, C_in * kh * kw)``, fp32, the columns of ``weight.reshape(C_out, -1)``), taken from as few
        randomly chosen examples as hold that many patch positions: only those examples are unfolded.
        ``counted``: ``(rows, patches of the whole input)``."""
        from lightning_monitor.probes.per_example.conv import unfold_input

        with torch.no_grad():
            x = x.detach()
            if x.dim() == 3:  # an unbatched input
                x = x.unsqueeze(0)
            gen = self._generator(x.device)
            positions = 1
            for size, k, s, d, p in zip(x.shape[2:], conv.kernel_size, conv.stride, conv.dilation,
                                        conv.padding if not isinstance(conv.padding, str) else (0, 0)):
                if conv.padding == "same":
                    positions *= size
                else:
                    positions *= max((size + 2 * p - d * (k - 1) - 1) // s + 1, 1)
            population = x.shape[0] * positions
            n = min(x.shape[0], -(-self.max_rows // positions))
            if n < x.shape[0]:
                x = x.index_select(0, torch.randperm(x.shape[0], generator=gen, device=x.device)[:n])
            rows = unfold_input(conv, x).transpose(1, 2).reshape(-1, x.shape[1] * conv.kernel_size[0] * conv.kernel_size[1])
            if rows.shape[0] > self.max_rows:
                idx = torch.randperm(rows.shape[0], generator=gen, device=rows.device)[: self.max_rows]
                rows = rows.index_select(0, idx)
            return (rows, population) if counted else rows

    def state_dict(self) -> dict[str, Optional[Any]]:
        return {"generators": {str(d): g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for device, g_state in state.get("generators", {}).items():
            self._generator(torch.device(device)).set_state(g_state)


def _is_identity(module: nn.Module, x: Tensor) -> bool:
    """Whether ``x`` is the identity matrix of ``module``'s input size (PEFT DoRA's call for its weight norm): checked
    only on a square 2-D input of that size made outside autograd (two reductions, on due steps)."""
    size = getattr(module, "in_features", None)
    if x.dim() != 2 or x.shape[0] != x.shape[1] or x.shape[1] != size or x.requires_grad:
        return False
    return bool(x.diagonal().eq(1).all()) and int(torch.count_nonzero(x)) == size
