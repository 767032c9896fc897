"""The handler registry: a new module type is covered by one @register'ed Handler, nothing else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_per_example import check
from torch import Tensor, nn

from lightning_monitor import PerExampleGradNorms
from lightning_monitor.probes.per_example import (
    HANDLERS,
    Handler,
    handler_for,
    project_matrix,
    register,
)


class Diag(nn.Module):
    """``y = x * w`` over the last dimension: example i's gradient is ``sum_t d_it * x_it`` (closed form)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.diag = Diag(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.diag(torch.tanh(self.inp(x)))))


class DiagHandler(Handler):
    def grads(self, m: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        return {"weight": (g.float() * x.float()).reshape(x.shape[0], -1, x.shape[-1]).sum(1)}

    def sq_norms(self, m: nn.Module, x: Tensor, g: Tensor, rule: object) -> dict[str, Tensor]:
        return {"weight": self.grads(m, x, g)["weight"].pow(2).sum(1)}

    def project(self, m: nn.Module, x: Tensor, g: Tensor, uv: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        return {"weight": project_matrix(self.grads(m, x, g)["weight"].sum(0), *uv["weight"])}


@pytest.fixture
def registered_diag():
    assert Diag not in HANDLERS
    register(Diag)(DiagHandler)
    yield
    del HANDLERS[Diag]


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def test_unregistered_type_is_uncovered() -> None:
    probe = PerExampleGradNorms(Model())
    assert probe.uncovered == ["diag.weight"]
    assert "no handler" in probe.reasons["diag.weight"]


@pytest.mark.parametrize("shape", [(5, 4), (5, 3, 4)])
def test_registered_type_is_exact(registered_diag, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(*shape), torch.randint(0, 3, shape[:-1])
    probe = check(model, ce, x, y)
    assert probe.uncovered == [] and "diag.weight" in probe.covered


def test_registered_type_used_twice_is_exact(registered_diag) -> None:
    class Twice(Model):
        def forward(self, x: Tensor) -> Tensor:
            return self.out(self.diag(torch.tanh(self.diag(torch.tanh(self.inp(x))))))

    torch.manual_seed(0)
    check(Twice(), ce, torch.randn(5, 3, 4), torch.randint(0, 3, (5, 3)))


def test_lookup_walks_the_mro(registered_diag) -> None:
    class SubDiag(Diag):
        pass

    assert isinstance(handler_for(SubDiag(3)), DiagHandler)
    assert handler_for(nn.Tanh()) is None
    assert handler_for(nn.Linear(2, 2)) is HANDLERS[nn.Linear]


def test_a_subclass_with_a_forward_of_its_own_is_checked_not_trusted(registered_diag) -> None:
    """A subclass inherits its base class's handler, and the probe's check of the first backward decides: one whose
    forward computes otherwise (here twice the base's output, as Gemma's embedding scales its rows) is left out with
    that reason; one whose forward computes the same in its own code (as Falcon's ``FalconLinear``) stays covered
    and exact. The other parameters stay exact either way."""

    class Scaled(Diag):
        def forward(self, x: Tensor) -> Tensor:
            return 2.0 * super().forward(x)

    class Same(Diag):
        def forward(self, x: Tensor) -> Tensor:
            return self.weight * x

    for sub, covered in ((Scaled, False), (Same, True)):
        model = Model()
        model.diag = sub(6)
        torch.manual_seed(0)
        probe = check(model, F.cross_entropy, torch.randn(7, 4), torch.randint(0, 3, (7,)))
        assert ("diag.weight" in probe.covered) == covered
        if not covered:
            assert probe.uncovered == ["diag.weight"]
            assert "computes otherwise than its handler assumes" in probe.reasons["diag.weight"]


def test_register_rejects_non_modules_and_non_handlers() -> None:
    with pytest.raises(TypeError):
        register(int)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        register(Diag)(object)  # type: ignore[type-var]
    assert Diag not in HANDLERS


def test_a_handler_that_fails_on_its_module_leaves_it_out_and_the_backward_goes_on():
    """A handler whose assumptions the module breaks (here one that raises in the backward: a subclass fed
    something else than its base class takes) costs that module its coverage, with the error as the reason; it
    never fails the backward, and every other parameter stays exact against torch.func."""

    class Broken(DiagHandler):
        def sq_norms(self, m, x, g, rule):
            raise IndexError("tensors used as indices must be long")

        def project(self, m, x, g, uv):
            raise IndexError("tensors used as indices must be long")

    register(Diag)(Broken)
    try:
        torch.manual_seed(0)
        probe = check(Model(), F.cross_entropy, torch.randn(7, 4), torch.randint(0, 3, (7,)))
    finally:
        del HANDLERS[Diag]
    assert probe.uncovered == ["diag.weight"]
    assert probe.reasons["diag.weight"].startswith("its handler failed on it (IndexError: tensors used as indices")
    assert set(probe.covered) == {"inp.weight", "inp.bias", "out.weight", "out.bias"}
