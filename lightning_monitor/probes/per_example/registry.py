"""The dispatch table from module type to :class:`Handler` (BackPACK-style), filled by :func:`register`.

Covering a new module type is one new file: a :class:`Handler` subclass decorated with
``@register(MyModule)`` (as opacus' ``register_grad_sampler``), imported once. Lookups walk the MRO, so
a subclass uses the handler of its nearest registered base class.

A type from an optional library (``transformers.pytorch_utils.Conv1D``) is registered by its qualified
name with :func:`register_by_name`, so that the probe never imports that library: a model holding such
a module has imported it already.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar, Union

from torch import Tensor, nn

__all__ = ["HANDLERS", "HANDLERS_BY_CODE", "HANDLERS_BY_NAME", "Handler", "handler_for", "register", "register_by_code",
           "register_by_name"]


class Handler:
    """How to compute per-example gradient norms of one module type. Subclass and override; the hooks
    call, for each use of a covered module in a forward pass:

    * :meth:`capture` at forward time, :meth:`sq_norms` when the backward reaches the module's output
      (or :meth:`grads` instead, for parameters used several times in one forward), and :meth:`project`
      when the probe verifies that the hooks saw every use of each parameter;
    * :meth:`unsupported` and :meth:`param_names` once, when the probe is built;
    * :meth:`patch_forward` when the probe is armed (optional: a replacement ``forward``).

    Every result is keyed by the module's local parameter name (``"weight"``, ``"bias"``) and is fp32.

    The probe hands every method the module's input with the batch along dimension 0: when the batch
    lies along another dimension (sequence-first ``[T, B, d]``), it is moved to the front first, which
    the handler allows for the leading :meth:`batch_dims` dimensions of the input.
    """

    def batch_dims(self, module: nn.Module, x: Tensor) -> int:
        """How many leading dimensions of the input ``x`` may hold the batch (the rest are the module's
        own feature dimensions). Default: all but the last (a Linear-form layer)."""
        return max(x.dim() - 1, 0)

    def declared_dim(self, module: nn.Module, dim: int) -> int:
        """A batch dimension declared (``batch_dims``) on the module's own input, in the frame of the input the
        probe hands this handler (the same but where a patched forward reorders it)."""
        return dim

    def unsupported(self, module: nn.Module) -> Optional[str]:
        """Why this instance cannot be covered, or ``None``."""
        return None

    def param_names(self, module: nn.Module) -> Optional[tuple[str, ...]]:
        """The local names of the module's own parameters this handler computes (``None``: all of them). Any other
        parameter the module holds (a subclass's own: loralib's ``lora_A`` / ``lora_B``, ``weight_g`` / ``weight_v``
        of ``torch.nn.utils.weight_norm``) is listed as uncovered, with the reason."""
        return None

    def refusal(self, module: nn.Module, x: Tensor) -> Optional[str]:
        """Why this call of the module cannot be measured, in its mode of the moment (a BatchNorm normalising with
        its batch's statistics), or ``None``. Its parameters are then left out with this reason."""
        return None

    def capture(self, module: nn.Module, x: Tensor) -> Any:
        """What the backward needs from the forward input ``x`` (keep references, compute nothing heavy);
        ``None`` skips this use (e.g. an input without a batch dimension)."""
        return x

    def sq_norms(self, module: nn.Module, ctx: Any, grad_output: Tensor, rule: Any) -> dict[str, Tensor]:
        """``{local name: Tensor[B]}``: each example's squared gradient norm. ``rule`` is the probe's
        :class:`~lightning_monitor.probes.per_example.strategy.LinearRule` (for Linear-form layers)."""
        raise NotImplementedError

    def grads(self, module: nn.Module, ctx: Any, grad_output: Tensor) -> dict[str, Tensor]:
        """``{local name: Tensor[B, *param.shape]}``: the materialised per-example gradients."""
        raise NotImplementedError

    def project(self, module: nn.Module, ctx: Any, grad_output: Tensor,
                uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        """``{local name: Tensor[k]}``: ``u_j^T C v_j`` for this use's contribution ``C`` to each
        parameter's batch gradient (as a ``(shape[0], -1)`` matrix), without forming ``C``; see
        :func:`~lightning_monitor.probes.per_example.kernels.project_matrix`."""
        raise NotImplementedError

    def patch_forward(self, module: nn.Module, uses: Any, rule: Any) -> Optional[Callable[..., Tensor]]:
        """A ``forward`` to install while the probe is armed, or ``None`` for a plain forward hook.
        ``uses`` is the probe's per-module recorder. The forward first calls ``uses.note(x)``, which says
        what to do with this call: ``"record"``: ``uses.record(x, output, rule)`` does what the plain
        forward hook does, or ``uses.expect(x)`` counts one use and returns the callback
        ``done(grad_output, results=None)`` that its backward must call once (``results``: its own
        ``(sq_fn, grads_fn, proj_fn)``, used when the batch lies along dimension 0); ``"skip"`` and
        ``"dry"``: the plain forward; ``"replay"``: the same operations as the recorded call (activation
        checkpointing recomputes it), recording nothing."""
        return None


#: Module type -> handler. Subclasses use their nearest registered base class (:func:`handler_for`).
HANDLERS: dict[type[nn.Module], Handler] = {}
#: ``"module.QualName"`` of a type -> (handler, predicate on the class or None) (:func:`register_by_name`).
HANDLERS_BY_NAME: dict[str, tuple[Handler, Optional[Callable[[type], bool]]]] = {}

#: (words of class names, predicate on a class, handler): for a class with no handler by type or by name whose name
#: contains one of the words and for which the predicate holds (:func:`register_by_code`); a match is kept per class.
HANDLERS_BY_CODE: list[tuple[tuple[str, ...], Callable[[type], bool], Handler]] = []
_BY_CODE_SEEN: dict[type, Handler] = {}

H = TypeVar("H", bound=Union[Handler, type])


def register(*module_types: type[nn.Module]) -> Callable[[H], H]:
    """Class (or instance) decorator: ``@register(nn.Linear)`` on a :class:`Handler` subclass makes it
    the handler of those module types (and of their subclasses without a handler of their own)."""
    if not module_types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in module_types):
        raise TypeError(f"register() takes nn.Module subclasses, got {module_types!r}.")

    def deco(handler: H) -> H:
        instance = handler() if isinstance(handler, type) else handler
        if not isinstance(instance, Handler):
            raise TypeError(f"register(): {handler!r} is not a Handler.")
        for t in module_types:
            HANDLERS[t] = instance
        return handler

    return deco


def register_by_name(*qualified_names: str, when: Optional[Callable[[type], bool]] = None) -> Callable[[H], H]:
    """Like :func:`register`, for types named ``"package.module.ClassName"`` (their defining module and
    ``__qualname__``), without importing them. ``when(cls)``, if given, must also hold for a class to use
    the handler (e.g. that its ``forward`` computes what the handler assumes)."""
    if not qualified_names or not all(isinstance(n, str) and "." in n for n in qualified_names):
        raise TypeError(f"register_by_name() takes 'package.module.ClassName' strings, got {qualified_names!r}.")

    def deco(handler: H) -> H:
        instance = handler() if isinstance(handler, type) else handler
        if not isinstance(instance, Handler):
            raise TypeError(f"register_by_name(): {handler!r} is not a Handler.")
        for n in qualified_names:
            HANDLERS_BY_NAME[n] = (instance, when)
        return handler

    return deco


def register_by_code(*words: str, when: Callable[[type], bool]) -> Callable[[H], H]:
    """Like :func:`register_by_name`, for the classes of no registered name or type whose name contains one of
    ``words`` and for which ``when(cls)`` holds (that their ``forward`` is the same code as a registered family's:
    the dozens of model files that copy Llama's RMSNorm under their own names)."""
    if not words or not all(isinstance(w, str) and w for w in words):
        raise TypeError(f"register_by_code() takes words of class names, got {words!r}.")

    def deco(handler: H) -> H:
        instance = handler() if isinstance(handler, type) else handler
        if not isinstance(instance, Handler):
            raise TypeError(f"register_by_code(): {handler!r} is not a Handler.")
        HANDLERS_BY_CODE.append((words, when, instance))
        _BY_CODE_SEEN.clear()
        return handler

    return deco


def handler_for(module: nn.Module) -> Optional[Handler]:
    """The handler of ``module``'s type or of its nearest registered base class (by type or by name), else of the
    code its class runs (:func:`register_by_code`)."""
    for cls in type(module).__mro__:
        handler = HANDLERS.get(cls)  # type: ignore[arg-type]
        if handler is not None:
            return handler
        if HANDLERS_BY_NAME:
            entry = HANDLERS_BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")
            if entry is not None and (entry[1] is None or entry[1](cls)):
                return entry[0]
    cls = type(module)
    handler = _BY_CODE_SEEN.get(cls)
    if handler is None:  # no match is not kept: a predicate may hold later (once the library it compares with is in)
        handler = next((h for words, when, h in HANDLERS_BY_CODE if any(w in cls.__name__ for w in words) and when(cls)),
                       None)
        if handler is not None:
            _BY_CODE_SEEN[cls] = handler
    return handler
