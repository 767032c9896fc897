"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN``: each weight is a Linear-form layer applied at every time step, to the
input sequence (``weight_ih``) or to the previous hidden state (``weight_hh``), but the fused kernel keeps the
gate pre-activations to itself. Neither has a module output per step to hook.

While the probe is armed, the module's own ``forward`` runs as ever (its outputs are bit for bit the plain
forward's) and one gradient hook on all its outputs receives their gradients together (the output sequence,
``h_n`` and, for an LSTM, ``c_n``; the model may still write into them in place, padded steps zeroed). There the recurrence is run again, in float32, on the same
input and initial state; the gradients of the outputs, sent back through it to each layer's input projection and to
each step's hidden projection (``torch.autograd.grad`` with respect to them), give each step's gate gradients ``D``. Each
example's gradient of ``weight_ih`` is then ``D_i^T A_i`` with ``A_i`` the layer's input sequence, and of
``weight_hh`` with ``A_i`` the previous hidden states (the rules of the Linear handler); the biases' are
``sum_t d_it``.

Covered: any number of layers, bidirectional, ``batch_first`` or not, an initial state given or not. Left out,
with the reason: ``proj_size > 0``; dropout between layers in training mode (its masks, drawn inside the fused
kernel, cannot be drawn again); a ``PackedSequence`` input.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from lightning_monitor.probes.per_example.kernels import linear_sq_norms, project_matrix
from lightning_monitor.probes.per_example.registry import Handler, register

__all__ = ["RecurrentHandler"]

_PACKED = "a PackedSequence input (sequences of several lengths packed together) has no per-example rule here"
_DROPOUT = ("dropout between its layers in training mode: the masks are drawn inside the fused kernel and cannot be "
            "drawn again for the per-example gradients")


def _step(m: nn.Module, gi: Tensor, gh: Tensor, h: Tensor, c: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """One step of the cell from its input projection ``gi`` and hidden projection ``gh`` (biases included)."""
    if m.mode == "LSTM":
        gates = gi + gh
        size = h.shape[-1]
        s = torch.sigmoid(gates)  # the input, forget and output gates (the cell gate's part is not used)
        c = s[:, size:2 * size] * c + s[:, :size] * torch.tanh(gates[:, 2 * size:3 * size])
        return s[:, 3 * size:] * torch.tanh(c), c
    if m.mode == "GRU":
        size = h.shape[-1]
        rz = torch.sigmoid(gi[:, :2 * size] + gh[:, :2 * size])
        r, z = rz[:, :size], rz[:, size:]
        n = torch.tanh(gi[:, 2 * size:] + r * gh[:, 2 * size:])
        return n + z * (h - n), None
    pre = gi + gh
    return (torch.tanh(pre) if m.mode == "RNN_TANH" else torch.relu(pre)), None


def _replay(m: nn.Module, x: Tensor, hx: Any, grads: tuple[Optional[Tensor], ...]) -> dict[str, tuple[Tensor, Tensor]]:
    """``{parameter name: (A, D)}``, ``(B, T, in)`` and ``(B, T, out)`` in float32 with the batch first: each weight's
    per-example gradient is ``D_i^T A_i``, its bias's ``sum_t D_i``. ``x``: the input, batch first; ``hx``: the
    initial state as given (``[layers * directions, B, H]``, a pair for an LSTM) or ``None``; ``grads``: the
    gradients of the output sequence (batch first), ``h_n`` and ``c_n`` (``None`` where none came)."""
    dirs = 2 if m.bidirectional else 1
    b, t = x.shape[:2]
    hidden = m.hidden_size
    h0 = c0 = None
    if hx is not None:
        h0, c0 = (hx if m.mode == "LSTM" else (hx, None))
        h0 = h0.detach().float()
        c0 = c0.detach().float() if c0 is not None else None
    wrt: list[Tensor] = []  # the projections whose gradients are the gate gradients
    # per layer and direction: its input sequence, the input projection, each step's hidden projection and state
    record: dict[str, tuple[Tensor, Tensor, list[Tensor], list[Tensor]]] = {}
    finals_h, finals_c = [], []
    with torch.enable_grad():
        layer_in = x.detach().float()
        for layer in range(m.num_layers):
            outs = []
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                w_ih, w_hh = getattr(m, "weight_ih" + sfx).detach().float(), getattr(m, "weight_hh" + sfx).detach().float()
                b_ih = getattr(m, "bias_ih" + sfx, None)
                b_hh = getattr(m, "bias_hh" + sfx, None)
                gi_all = (torch.addmm(b_ih.detach().float(), layer_in.reshape(b * t, -1), w_ih.T).view(b, t, -1)
                          if b_ih is not None else layer_in @ w_ih.T)
                if not gi_all.requires_grad:  # layer 0: its input is no function of the weights; made a leaf
                    gi_all.requires_grad_(True)
                wrt.append(gi_all)
                k = layer * dirs + d
                h = h0[k] if h0 is not None else x.new_zeros(b, hidden, dtype=torch.float32)
                c = (c0[k] if c0 is not None else x.new_zeros(b, hidden, dtype=torch.float32)) if m.mode == "LSTM" else None
                order = range(t - 1, -1, -1) if d else range(t)
                hs: list[Optional[Tensor]] = [None] * t
                prev: list[Optional[Tensor]] = [None] * t
                ghs: list[Optional[Tensor]] = [None] * t
                bias_hh = b_hh.detach().float() if b_hh is not None else None
                steps = gi_all.unbind(1)  # one backward node for all steps (a slice each would zero-fill the whole)
                for s in order:
                    prev[s] = h
                    gh = torch.addmm(bias_hh, h, w_hh.T) if bias_hh is not None else h @ w_hh.T
                    if not gh.requires_grad:  # the first step of a fixed initial state
                        gh.requires_grad_(True)
                    ghs[s] = gh
                    h, c = _step(m, steps[s], gh, h, c)
                    hs[s] = h
                wrt.extend(ghs)  # type: ignore[arg-type]
                finals_h.append(h)
                if c is not None:
                    finals_c.append(c)
                record[sfx] = (layer_in, gi_all, ghs, prev)  # type: ignore[assignment]
                outs.append(torch.stack(hs, 1))  # type: ignore[arg-type]
            layer_in = torch.cat(outs, -1) if dirs > 1 else outs[0]
        outputs: list[Tensor] = [layer_in, torch.stack(finals_h)]
        if m.mode == "LSTM":
            outputs.append(torch.stack(finals_c))
        pairs = [(o, g.float()) for o, g in zip(outputs, grads) if g is not None]
        found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    grad_of = {id(t): (g if g is not None else torch.zeros_like(t)) for t, g in zip(wrt, found)}
    out: dict[str, tuple[Tensor, Tensor]] = {}
    for sfx, (a_in, gi_all, ghs, prev) in record.items():
        d_in = grad_of[id(gi_all)]
        d_hh = torch.stack([grad_of[id(gh)] for gh in ghs], 1)
        a_hh = torch.stack([p.detach() for p in prev], 1)
        out["weight_ih" + sfx] = (a_in.detach(), d_in)
        out["weight_hh" + sfx] = (a_hh, d_hh)
        if getattr(m, "bias_ih" + sfx, None) is not None:
            out["bias_ih" + sfx] = (a_in.new_ones(0), d_in)
            out["bias_hh" + sfx] = (a_hh.new_ones(0), d_hh)
    return out


@register(nn.LSTM, nn.GRU, nn.RNN)
class RecurrentHandler(Handler):
    """See the module docstring: the gate gradients from a float32 replay of the recurrence, in a gradient hook on
    the module's outputs; per weight the Linear form ``D_i^T A_i``."""

    def unsupported(self, m: nn.Module) -> Optional[str]:
        if getattr(m, "proj_size", 0) > 0:
            return "an LSTM with proj_size > 0 has no per-example rule here"
        if m.mode not in ("LSTM", "GRU", "RNN_TANH", "RNN_RELU"):
            return f"recurrent mode {m.mode!r} has no per-example rule here"
        return None

    def param_names(self, m: nn.Module) -> tuple[str, ...]:
        return tuple(m._flat_weights_names)

    def batch_dims(self, m: nn.Module, x: Tensor) -> int:
        return 1  # the patched forward hands the probe its input batch first

    def declared_dim(self, m: nn.Module, dim: int) -> int:
        # declared on the module's input ([T, B, d] without batch_first: the batch along 1), read on the batch-first
        # input the patched forward hands the probe (the time and batch dimensions swapped)
        return dim if m.batch_first or dim not in (0, 1) else 1 - dim

    def capture(self, m: nn.Module, x: Tensor) -> Any:
        return None  # only the patched forward records uses

    def sq_norms(self, m: nn.Module, ctx: Any, g: Tensor, rule: Any) -> dict[str, Tensor]:
        raise NotImplementedError("recurrent modules are measured in their patched forward's backward")

    def patch_forward(self, m: nn.Module, uses: Any, rule: Any) -> Optional[Callable[..., Any]]:
        forward = type(m).forward

        def patched(input: Any, hx: Any = None) -> Any:
            if isinstance(input, PackedSequence) and uses.params and torch.is_grad_enabled():
                uses.probe._refused.setdefault(uses.name, _PACKED)
            if isinstance(input, PackedSequence) or not uses.params or input.dim() != 3:
                return forward(m, input, hx)
            xb = input if m.batch_first else input.transpose(0, 1)
            mode = uses.note(xb)
            output, state = forward(m, input, hx)
            if mode != "record" or not torch.is_grad_enabled():
                return output, state
            if m.dropout > 0 and m.training and m.num_layers > 1:
                uses.probe._refused.setdefault(uses.name, _DROPOUT)
                return output, state
            done = uses.expect(xb)
            first = m.batch_first
            x_saved = xb.detach()
            hx_saved = (tuple(h.detach() for h in hx) if isinstance(hx, tuple) else hx.detach()) if hx is not None else None

            def sink(grads: tuple[Optional[Tensor], ...]) -> None:
                g_out = grads[0]
                if g_out is not None and not first:
                    g_out = g_out.transpose(0, 1)
                batch_grad = g_out if g_out is not None else x_saved.new_zeros(x_saved.shape[0], 1)
                kept: list[dict[str, tuple[Tensor, Tensor]]] = []

                def pieces() -> dict[str, tuple[Tensor, Tensor]]:
                    # run when the probe asks, inside its guard: a replay that fails (weights it cannot read) leaves
                    # the module out with the error as the reason, and never fails the training step
                    if not kept:
                        kept.append(_replay(m, x_saved, hx_saved, (g_out, *grads[1:])))
                    return kept[0]

                def sq() -> dict[str, Tensor]:
                    out = {}
                    for name, (a, d) in pieces().items():
                        out[name] = d.sum(1).pow(2).sum(1) if name.startswith("bias") else linear_sq_norms(a, d)
                    return out

                def per_example() -> dict[str, Tensor]:
                    return {name: d.sum(1) if name.startswith("bias") else torch.bmm(d.transpose(1, 2), a)
                            for name, (a, d) in pieces().items()}

                def proj(uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
                    out = {}
                    for name, (u, v) in uv.items():
                        a, d = pieces()[name]
                        total = d.sum((0, 1)) if name.startswith("bias") else torch.einsum("btg,bti->gi", d, a)
                        out[name] = project_matrix(total, u, v)
                    return out

                with torch.no_grad():
                    done(batch_grad, (sq, per_example, proj))

            tensors = (output, *(state if isinstance(state, tuple) else (state,)))
            # a hook on the outputs themselves, not an identity Function returning views of them: the model may write
            # into the output in place (padded steps zeroed), which autograd forbids on a multi-output Function's views
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda gs: sink(tuple(gs)))
            return output, state

        return patched
