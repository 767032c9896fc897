"""Capture a bounded random subsample of the input rows of chosen layers, on demand.

:class:`InputCapture` installs nothing until :meth:`InputCapture.arm` is called (on a monitored step
only). Each armed layer then records, on its forward call, at most ``max_rows`` rows of its
input ``x[..., in_features]`` (all leading dimensions flattened: batch, sequence, ...; for an ``nn.Conv2d``
its input patches, the rows its weight ``[C_out, C_in * kh * kw]`` multiplies), picked at random
without replacement, detached, in their own dtype and on their own device. The rows of the second call of the
step replace those of the first (PEFT's DoRA calls its adapters on the identity before the data, to compute
their weight norm; for a layer called once, the second call is a recomputation or the next micro-batch of the
step, rows like the first's); the hook then removes itself, so later calls cost nothing.
:meth:`InputCapture.take` hands the rows over and forgets them.

The random rows come from the capture's own generator: arming does not touch the global RNG, so a
run with the monitor draws the same dropout masks and batches as a run without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_monitor.probes import call_args, in_dry_run

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
        self._handles: dict[str, RemovableHandle] = {}
        self._captured: dict[str, Tensor] = {}
        self._seen_once: set[str] = set()
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def armed(self) -> bool:
        """Whether any hook is installed now."""
        return bool(self._handles)

    def arm(self, names: Optional[Iterable[str]] = None) -> None:
        """Install a one-shot pre-hook on every module (or those of ``names``) that has not captured yet
        (idempotent)."""
        for name in self.modules if names is None else names:
            if name in self._handles or name in self._captured:
                continue
            self._handles[name] = self.modules[name].register_forward_pre_hook(self._make_hook(name), with_kwargs=True)

    def disarm(self) -> None:
        """Remove every hook still installed."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._seen_once.clear()

    def take(self) -> dict[str, Tensor]:
        """The rows captured since :meth:`arm` (``name -> (rows, in)``; layers that did not run are
        absent); removes the remaining hooks and drops the capture's references."""
        self.disarm()
        out, self._captured = self._captured, {}
        return out

    def release(self) -> None:
        """Forget everything captured and remove every hook."""
        self.disarm()
        self._captured = {}

    # ------------------------------------------------------------------ internals
    def _disarm(self, name: str) -> None:
        handle = self._handles.pop(name, None)
        if handle is not None:
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
            if in_dry_run():  # another monitor's run of the module on a batch of its own
                return
            args = call_args(args, kwargs, module)
            if not args or not isinstance(args[0], Tensor):
                self._disarm(name)
                return
            x = args[0]
            # the first two calls of the step are read and the second one kept: PEFT's DoRA first calls its adapters
            # on the identity (`lora_B(lora_A(eye))`, for its weight norm), then on the data. A layer called once
            # keeps its first call's rows (a later recomputation or micro-batch of the step reads rows like them)
            if name in self._captured or name in self._seen_once:
                self._disarm(name)
            else:
                self._seen_once.add(name)
            if isinstance(module, nn.Conv2d):
                self._captured[name] = self.sample_patches(module, x)
            else:
                self._captured[name] = self.sample(x)

        return hook

    def sample(self, x: Tensor) -> Tensor:
        """At most ``max_rows`` random rows of ``x`` flattened to ``(-1, x.shape[-1])``, detached."""
        with torch.no_grad():
            rows = x.detach().reshape(-1, x.shape[-1])
            n = rows.shape[0]
            if n > self.max_rows:
                idx = torch.randperm(n, generator=self._generator(rows.device), device=rows.device)[: self.max_rows]
                rows = rows.index_select(0, idx)
            else:
                rows = rows.clone()
        return rows

    def sample_patches(self, conv: nn.Conv2d, x: Tensor) -> Tensor:
        """At most ``max_rows`` random input patches of ``conv`` (rows of its unfolded input,
        ``(rows, C_in * kh * kw)``, fp32, the columns of ``weight.reshape(C_out, -1)``), taken from as few
        randomly chosen examples as hold that many patch positions: only those examples are unfolded."""
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
            n = min(x.shape[0], -(-self.max_rows // positions))
            if n < x.shape[0]:
                x = x.index_select(0, torch.randperm(x.shape[0], generator=gen, device=x.device)[:n])
            rows = unfold_input(conv, x).transpose(1, 2).reshape(-1, x.shape[1] * conv.kernel_size[0] * conv.kernel_size[1])
            if rows.shape[0] > self.max_rows:
                idx = torch.randperm(rows.shape[0], generator=gen, device=rows.device)[: self.max_rows]
                rows = rows.index_select(0, idx)
            return rows

    def state_dict(self) -> dict[str, Optional[Any]]:
        return {"generators": {str(d): g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for device, g_state in state.get("generators", {}).items():
            self._generator(torch.device(device)).set_state(g_state)
