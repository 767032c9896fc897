"""GradientEarlyStopping's `reference_at`: where the relative reference is taken ("early" | "grace_end")."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientEarlyStopping

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import fit_ddp_spawn  # noqa: E402
from test_grades_callback import N_COMPONENTS, DeadBranchLM, _csv_rows, _loader, _module, _trainer  # noqa: E402
from gpt import make_loader  # noqa: E402  (examples/ is on the path through test_grades_callback)


def _smoothed_from_logs(rows: dict[int, dict[str, float]], names: list[str], checks: list[int], smoothing: float
                        ) -> dict[int, np.ndarray]:
    """The EMA of the logged `grades/<c>/stat` values at each check (the oracle of the smoothed statistic)."""
    out: dict[int, np.ndarray] = {}
    m = None
    for s in checks:
        x = np.array([rows[s][f"grades/{n}/stat"] for n in names])
        m = x if m is None else smoothing * m + (1 - smoothing) * x
        out[s] = m
    return out


def test_grace_end_reference_is_the_smoothed_statistic_at_the_end_of_the_grace_period(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e-9, every_n_steps=3, grace_steps=7, smoothing=0.5, reference_at="grace_end")
    logger = CSVLogger(tmp_path)
    _trainer(tmp_path, [cb], max_steps=19, logger=logger).fit(_module(), _loader())
    assert cb.frozen == {}
    rows = _csv_rows(logger)
    names = cb.components
    checks = [0, 3, 6, 9, 12, 15, 18]
    smoothed = _smoothed_from_logs(rows, names, checks, 0.5)
    # the first check at or after grace_end=7 is step 9
    np.testing.assert_allclose(cb.reference().numpy(), smoothed[9], rtol=1e-5)
    assert not any(k.endswith("/ratio") for s in (0, 3, 6) for k in rows[s])  # no reference yet
    for s in (9, 12, 15, 18):
        np.testing.assert_allclose([rows[s][f"grades/{n}/ratio"] for n in names], smoothed[s] / smoothed[9], rtol=1e-4)
    state = cb.state_dict()
    assert state["reference_at"] == "grace_end"
    np.testing.assert_allclose(state["reference"], smoothed[9], rtol=1e-5)


def test_early_reference_is_the_mean_of_the_first_checks(tmp_path: Path) -> None:
    cb = GradientEarlyStopping(tau=1e-9, every_n_steps=3, grace_steps=7, reference_checks=3, reference_at="early")
    logger = CSVLogger(tmp_path)
    _trainer(tmp_path, [cb], max_steps=10, logger=logger).fit(_module(), _loader())
    rows = _csv_rows(logger)
    stats = np.array([[rows[s][f"grades/{n}/stat"] for n in cb.components] for s in (0, 3, 6)])
    np.testing.assert_allclose(cb.reference().numpy(), stats.mean(0), rtol=1e-5)


@pytest.mark.parametrize(("grace", "expected"), [(6, 9), (7, 12), (0, 3)])
def test_grace_end_freezes_from_the_check_after_the_reference(tmp_path: Path, grace: int, expected: int) -> None:
    # tau far above 1: every component is under it at its first judged check, which follows the reference's
    cb = GradientEarlyStopping(tau=1e6, every_n_steps=3, grace_steps=grace, reference_at="grace_end")
    trainer = _trainer(tmp_path, [cb], max_steps=40)
    trainer.fit(_module(), _loader())
    assert cb.frozen == {n: expected for n in cb.components} and len(cb.frozen) == N_COMPONENTS
    assert cb.stopped_at == expected and trainer.global_step == expected + 1


@pytest.mark.parametrize("stop_at", [5, 14])  # before and after the reference (step 9) is taken
def test_resume_keeps_the_grace_end_reference(tmp_path: Path, stop_at: int) -> None:
    kwargs: dict[str, Any] = dict(tau=1e-9, every_n_steps=3, grace_steps=7, smoothing=0.5, reference_at="grace_end")
    first = GradientEarlyStopping(**kwargs)
    trainer = _trainer(tmp_path / "a", [first], max_steps=stop_at)
    trainer.fit(_module(), _loader())
    ckpt = str(tmp_path / "a.ckpt")
    trainer.save_checkpoint(ckpt)
    saved_smoothed = np.array(first.state_dict()["smoothed"])
    saved_reference = first.reference()
    assert (saved_reference is None) == (stop_at < 9)

    resumed = GradientEarlyStopping(**kwargs)
    logger = CSVLogger(tmp_path / "b")
    _trainer(tmp_path / "b", [resumed], max_steps=19, logger=logger).fit(_module(seed=1), _loader(), ckpt_path=ckpt)
    if saved_reference is not None:  # kept as saved, not taken again
        torch.testing.assert_close(resumed.reference(), saved_reference, rtol=0, atol=0)
    else:  # taken at step 9 from the smoothed statistic carried on from the checkpoint
        rows = _csv_rows(logger)
        m = saved_smoothed
        for s in (6, 9):
            m = 0.5 * m + 0.5 * np.array([rows[s][f"grades/{n}/stat"] for n in resumed.components])
        np.testing.assert_allclose(resumed.reference().numpy(), m, rtol=1e-5)
    assert resumed.frozen == {}


def test_resume_with_another_rule_drops_the_reference_with_a_warning(tmp_path: Path) -> None:
    first = GradientEarlyStopping(tau=1e-9, every_n_steps=3, grace_steps=3, reference_at="early")
    trainer = _trainer(tmp_path / "a", [first], max_steps=10)
    trainer.fit(_module(), _loader())
    state = first.state_dict()
    other = GradientEarlyStopping(tau=1e-9, every_n_steps=3, grace_steps=3, reference_at="grace_end")
    with pytest.warns(UserWarning, match="reference_at='early'"):
        other.load_state_dict(state)
    assert other.reference() is None
    # a checkpoint from before the option (no key) was written by the "early" rule: loads as is
    state.pop("reference_at")
    again = GradientEarlyStopping(tau=1e-9, every_n_steps=3, grace_steps=3, reference_at="early")
    again.load_state_dict(state)
    torch.testing.assert_close(again.reference(), first.reference())


@pytest.mark.parametrize("value", ["late", "", None, 1, "Early"])
def test_bad_reference_at(value: Any) -> None:
    with pytest.raises(ValueError, match="`reference_at` must be 'early'"):
        GradientEarlyStopping(reference_at=value)


class DeadBranchRefLM(DeadBranchLM):
    """DeadBranchLM that also writes the monitor's reference on every rank."""

    def on_train_end(self) -> None:
        super().on_train_end()
        cb = next(c for c in self.trainer.callbacks if isinstance(c, GradientEarlyStopping))
        path = os.path.join(self.out_dir, f"rank{self.global_rank}.json")
        with open(path, encoding="utf-8") as fh:
            out = json.load(fh)
        out["reference"] = [float(x) for x in cb.reference().cpu().tolist()]
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(out, fh)


def test_ddp_two_ranks_take_the_same_grace_end_reference(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    cb = GradientEarlyStopping(tau=1e-4, every_n_steps=2, grace_steps=4, reference_at="grace_end")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn_find_unused_parameters_true", max_steps=12,
        logger=CSVLogger(tmp_path), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[cb], default_root_dir=tmp_path,
    )
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # see test_ddp_two_ranks_freeze_identically
    try:
        fit_ddp_spawn(trainer, DeadBranchRefLM(str(tmp_path)), make_loader("arith", block_size=16, batch_size=4, n_samples=256))
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # the dead gate_proj (gradient exactly 0: reference 0, ratio 0) freezes at the check after the reference (4)
    assert r0["frozen"] == r1["frozen"] == {"blocks.0.gate_proj": 6, "blocks.1.gate_proj": 6}
    assert r0["reference"] == r1["reference"]  # derived from all-reduced values: bit-identical
    assert r0["global_step"] == r1["global_step"] == 12
    assert r0["weights"] == pytest.approx(r1["weights"], rel=1e-6)


class LateBlockLM(pl.LightningModule):
    """Two blocks; the second joins the forward at step ``join`` (a staged model), and every gradient shrinks
    geometrically (the loss is scaled by ``0.85 ** step``), so each block's statistic falls far below its first values."""

    def __init__(self, join: int) -> None:
        super().__init__()
        self.join = join
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 1)
        self.first_grad: dict[str, int] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.blocks[0](x))
        if self.global_step >= self.join:
            h = h + torch.tanh(self.blocks[1](h))
        return (0.85 ** self.global_step) * F.mse_loss(self.head(h).squeeze(-1), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for i, block in enumerate(self.blocks):
            if block.weight.grad is not None:
                self.first_grad.setdefault(f"blocks.{i}", self.global_step)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_early_reference_of_a_component_that_joins_later_is_its_own_first_values(tmp_path: Path) -> None:
    # the run's first three checks (steps 0-2) see no gradient of blocks.1: its reference is the mean of its own first
    # three statistics (steps 20-22), and it freezes once its statistic falls below tau of that. Before, its reference
    # was 0 (a sum of nothing), its ratio inf: it never froze (and, counted for the stop once used, kept a run with
    # stop=True from stopping)
    torch.manual_seed(0)
    x = torch.randn(2048, 8)
    loader = DataLoader(TensorDataset(x, x.sum(-1)), batch_size=8)
    cb = GradientEarlyStopping(include=["blocks.*"], reference_at="early", reference_checks=3, tau=0.5, smoothing=0.0,
                               every_n_steps=1, grace_steps=5, min_loss_progress=None, stop=False)
    logger = CSVLogger(tmp_path)
    model = LateBlockLM(join=20)
    _trainer(tmp_path, [cb], max_steps=80, logger=logger).fit(model, loader)
    rows = _csv_rows(logger)
    assert model.first_grad == {"blocks.0": 0, "blocks.1": 20}
    stat = {s: rows[s]["grades/blocks.1/stat"] for s in (20, 21, 22)}
    reference = float(np.mean(list(stat.values())))
    assert cb.reference()[cb.components.index("blocks.1")].item() == pytest.approx(reference, rel=1e-5)
    # judged from its third value on: frozen at the first check whose (raw) statistic is below tau * reference
    below = [s for s in sorted(rows) if s >= 22 and rows[s].get("grades/blocks.1/stat", np.inf) < 0.5 * reference]
    assert cb.frozen["blocks.1"] == below[0]
    assert rows[below[0]]["grades/blocks.1/ratio"] == pytest.approx(rows[below[0]]["grades/blocks.1/stat"] / reference,
                                                                    rel=1e-5)


def test_early_reference_waits_for_a_component_without_values() -> None:
    cb = GradientEarlyStopping(reference_at="early", reference_checks=2)
    cb._ref_sum, cb._ref_cnt = torch.tensor([3.0, 0.0]), torch.tensor([2.0, 0.0])
    ref = cb.reference()
    assert ref[0].item() == 1.5 and math.isnan(ref[1].item())  # not a reference of 0 (which never lets it freeze)


def test_a_resume_with_the_very_module_trained_takes_back_the_components_frozen(tmp_path: Path) -> None:
    # the components GradES froze are frozen (requires_grad False) on the module trained: resumed with that module
    # (a notebook's second `fit`), they were taken for components frozen before the run and left out, and the
    # checkpoint's components no longer matched ("written for other components (12 ...) than this model has (6 ...)")
    kw = dict(every_n_steps=2, grace_steps=4, min_loss_progress=None)
    probe = GradientEarlyStopping(tau=1e-9, **kw)
    logger = CSVLogger(tmp_path / "probe")
    _trainer(tmp_path, [probe], max_steps=7, logger=logger).fit(_module(), _loader())
    ratios = sorted(v for k, v in _csv_rows(logger)[6].items() if k.endswith("/ratio"))
    tau = ratios[len(ratios) // 2]  # half the components below it at the check of step 6
    first = GradientEarlyStopping(tau=tau, **kw)
    module = _module()
    trainer = _trainer(tmp_path, [first], max_steps=8)
    trainer.fit(module, _loader())
    assert 0 < len(first.frozen) < N_COMPONENTS
    trainer.save_checkpoint(str(tmp_path / "a.ckpt"))
    again = GradientEarlyStopping(tau=tau, **kw)
    _trainer(tmp_path / "again", [again], max_steps=12).fit(module, _loader(), ckpt_path=str(tmp_path / "a.ckpt"))
    assert again.components == first.components and set(first.frozen) <= set(again.frozen)
    frozen = {n for n in again.frozen}
    for name, comp in again._components.items():
        assert comp.weight.requires_grad == (name not in frozen), name


class _Spike(pl.Callback):
    def __init__(self, at: Optional[int]) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for group in trainer.optimizers[0].param_groups:
            if trainer.global_step == self.at:
                group["lr"] *= 1000
            elif self.at is not None and trainer.global_step == self.at + 1:
                group["lr"] /= 1000


def test_a_rollback_takes_back_the_statistics_of_the_steps_it_undid(tmp_path: Path) -> None:
    # the reference was taken at step 41 from gradients of weights the guard rolled back in that step (60 times the
    # spike-free twin's), and every component froze: the run stopped at step 66, its twin froze none
    from lightning_monitor import DivergenceGuard

    out = {}
    for at in (None, 40):
        grades = GradientEarlyStopping(every_n_steps=1, grace_steps=41, min_loss_progress=None)
        guard = DivergenceGuard(every_n_steps=2)
        _trainer(tmp_path / str(at), [_Spike(at), grades, guard], max_steps=70).fit(_module(), _loader())
        out[at] = (grades.reference(), dict(grades.frozen), grades.stopped_at, [r["to_step"] for r in guard.rollbacks])
    ref, frozen, stopped, rollbacks = out[40]
    assert rollbacks and rollbacks[0] == 40 and out[None][3] == []
    assert out[None][1] == {} and frozen == {} and stopped is None
    torch.testing.assert_close(ref, out[None][0], rtol=0.25, atol=0.0)
