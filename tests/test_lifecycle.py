"""The lifecycle Monitor runs for a monitor: select once per fit, arm on due steps only, compute and
judge once per checked step, the judged values logged, and every kept hook released after the check
and when the fit fails; a batch without an optimizer step keeps its step armed once."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import tb_scalars
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

import lightning_monitor as lm
from lightning_monitor.callbacks.base import NothingToWatch, Streak


class _Recorder(lm.Monitor):
    """Counts the calls of each stage; arms one forward hook on the first Linear of the model."""

    name = "rec"

    def __init__(self, every_n_steps: int = 3, skip: tuple[int, ...] = (), nothing: bool = False) -> None:
        super().__init__(every_n_steps=every_n_steps)
        self.calls: list[tuple[str, int]] = []
        self.skip, self.nothing, self.seen = skip, nothing, 0

    def select(self, trainer, pl_module) -> None:
        self.calls.append(("select", trainer.global_step))
        if self.nothing:
            raise NothingToWatch("a model without what this monitor watches")
        self.layer = next(m for m in pl_module.modules() if isinstance(m, nn.Linear))

    def arm(self, trainer, pl_module, step):
        self.calls.append(("arm", step))
        if step in self.skip:
            return False
        self.keep(self.layer.register_forward_hook(lambda *_: setattr(self, "seen", self.seen + 1)))
        return None

    def compute(self, trainer, pl_module, step):
        self.calls.append(("compute", step))
        return {self.key("value"): torch.tensor(float(step)), "\x00hidden": torch.ones(3)}

    def judge(self, trainer, step, values):
        self.calls.append(("judge", step))
        assert values["\x00hidden"] == [1.0, 1.0, 1.0]  # one transfer: the vector as a list, a scalar as a float
        return {self.key("value"): values[self.key("value")] * 2}


def _trainer(tmp_path, callbacks, max_steps: int = 10) -> pl.Trainer:
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="tb"),
                      callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False)


def test_stages_run_on_due_steps_and_the_judged_values_are_logged(tmp_path, tiny_gpt):
    pl.seed_everything(0)
    module, loader = tiny_gpt()
    rec = _Recorder(every_n_steps=3, skip=(6,))
    trainer = _trainer(tmp_path, [rec])
    trainer.fit(module, loader)
    assert rec.calls[0] == ("select", 0) and [c for c in rec.calls if c[0] == "select"] == [("select", 0)]
    assert [c for c in rec.calls if c[0] == "arm"] == [("arm", 0), ("arm", 3), ("arm", 6), ("arm", 9)]
    # step 6 was skipped by arm: neither computed nor judged
    assert [c for c in rec.calls if c[0] == "compute"] == [("compute", 0), ("compute", 3), ("compute", 9)]
    assert [c for c in rec.calls if c[0] == "judge"] == [("judge", 0), ("judge", 3), ("judge", 9)]
    assert rec.seen == 3  # the hook saw the forward of each armed step only
    assert tb_scalars(trainer.logger.log_dir)["rec/value"] == [(0, 0.0), (3, 6.0), (9, 18.0)]
    assert float(trainer.callback_metrics["rec/value"]) == 18.0
    assert not any(m._forward_hooks for m in module.modules())


def test_a_batch_skipped_on_a_due_step_is_not_checked_and_leaves_no_hook(tmp_path, tiny_gpt):
    pl.seed_everything(0)
    module, loader = tiny_gpt()
    step_of = module.training_step

    def training_step(batch, batch_idx):  # None: Lightning skips the backward, and steps with no gradient
        return None if batch_idx == 0 else step_of(batch, batch_idx)

    module.training_step = training_step
    rec = _Recorder(every_n_steps=3)
    trainer = _trainer(tmp_path, [rec], max_steps=4)
    trainer.fit(module, loader)
    # batch 0 armed step 0, whose optimizer step came with no gradient anywhere: nothing to check there (the step
    # counts, so batch 1 is step 1); its hook was released by the next batch start, and none stacked up
    assert [c for c in rec.calls if c[0] == "arm"] == [("arm", 0), ("arm", 3)]
    assert [c for c in rec.calls if c[0] == "compute"] == [("compute", 3)]
    assert not any(m._forward_hooks for m in module.modules())


def test_hooks_are_released_when_the_fit_fails(tmp_path, tiny_gpt):
    pl.seed_everything(0)
    module, loader = tiny_gpt()
    step_of = module.training_step

    def training_step(batch, batch_idx):
        if batch_idx == 3:
            raise RuntimeError("boom")
        return step_of(batch, batch_idx)

    module.training_step = training_step
    rec = _Recorder(every_n_steps=3)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, [rec]).fit(module, loader)
    assert ("arm", 3) in rec.calls and ("compute", 3) not in rec.calls  # armed, then the step failed
    assert not any(m._forward_hooks for m in module.modules())


def test_nothing_to_watch_aborts_or_idles(tmp_path, tiny_gpt):
    module, loader = tiny_gpt()
    with pytest.raises(NothingToWatch, match="_Recorder: a model without"):
        _trainer(tmp_path, [_Recorder(nothing=True)], max_steps=2).fit(module, loader)
    idle = _Recorder(nothing=True)
    idle.idle_when_nothing_to_watch = True
    _trainer(tmp_path, [idle], max_steps=4).fit(module, loader)
    assert idle.calls == [("select", 0)] and idle.idle_reason == "a model without what this monitor watches"
    assert [a.kind for a in idle.hub.history] == ["nothing_to_watch"]


def test_streak_counts_consecutive_holds():
    s = Streak()
    assert [s.update(a) for a in (True, True, False, True, True, True)] == [1, 2, 0, 1, 2, 3]
    assert s >= 3 and not s >= 4 and s.count == 3


def test_the_state_key_is_computed_once_per_fit_and_follows_the_configuration_between_fits(tmp_path, tiny_gpt):
    """Lightning reads ``state_key`` at every hook call of every callback: within a fit the key is the one computed
    at setup; a configuration changed before the next fit gives that fit its new key (and the checkpoint its name)."""

    class _Counting(_Recorder):
        computed = 0

        def _state_key(self) -> str:
            type(self).computed += 1
            return super()._state_key()

    pl.seed_everything(0)
    module, loader = tiny_gpt()
    rec = _Counting(every_n_steps=3)
    assert rec.state_key.endswith("_Counting{'every_n_steps': 3, 'warmup_steps': 0}")
    counts = []
    for steps in (6, 18):
        _Counting.computed = 0
        _trainer(tmp_path, [rec], max_steps=steps).fit(module, loader)
        counts.append(_Counting.computed)
    # a few reads around setup and teardown, none per step (Lightning reads the key at every hook call)
    assert counts[0] == counts[1] <= 4
    rec.every_n_steps = 4
    assert rec.state_key.endswith("_Counting{'every_n_steps': 4, 'warmup_steps': 0}")  # after the fit: from the arguments
    path = str(tmp_path / "last.ckpt")
    trainer = _trainer(tmp_path, [rec], max_steps=4)
    trainer.fit(module, loader)
    trainer.save_checkpoint(path)
    assert rec.state_key in torch.load(path, weights_only=False)["callbacks"]
