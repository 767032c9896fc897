"""Ranks that plan different numbers of optimizer steps (their data give them different numbers of batches, a sampler
of the user's): the rank with more steps waits at the end for gradient reductions the others never make. Without the
suite such a DDP fit fails as the first rank exits; with it, the checks' own reductions kept every rank waiting, and a
run of 44 and 33 planned steps hung with no word. The guard now says so at the start of the fit (one reduction).

The reduction is the strategy's (`reduce(..., reduce_op="max")`): here a stand-in for the other rank's plan, since a
real two-rank run of that kind does not end."""

from types import SimpleNamespace

import torch

from lightning_monitor import DivergenceGuard
from lightning_monitor.alerts import AlertHub


def _trainer(mine: float, other: float):
    def reduce(t, reduce_op):
        assert reduce_op == "max"
        return torch.maximum(t, torch.tensor([other, -other], dtype=t.dtype))

    class Trainer:  # weak references are taken to a trainer
        pass

    trainer = Trainer()
    trainer.__dict__.update(estimated_stepping_batches=mine, global_step=0, global_rank=0, world_size=2, loggers=[],
                            strategy=SimpleNamespace(root_device=torch.device("cpu"), reduce=reduce))
    return trainer


def _said(mine: float, other: float):
    guard = DivergenceGuard()
    trainer = _trainer(mine, other)
    guard._hub = AlertHub(trainer)
    guard._say_uneven_ranks(trainer)
    return [a for a in guard._hub.history if a.kind == "uneven_ranks"]


def test_ranks_planning_different_step_counts_are_warned_about():
    for mine, other in ((44.0, 33.0), (33.0, 44.0)):
        said = _said(mine, other)
        assert len(said) == 1 and said[0].severity == "warning" and said[0].value == 11.0
        assert "(33 to 44)" in said[0].message and "max_steps" in said[0].message


def test_equal_plans_say_nothing():
    assert _said(40.0, 40.0) == []
    assert _said(float("inf"), float("inf")) == []  # data without a length on every rank
