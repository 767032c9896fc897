"""DivergenceGuard with several optimizers (a GAN, manual optimization): one loss series, never two mixed."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from test_several_optimizers import GAN
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import DivergenceGuard


class _Recording(DivergenceGuard):
    def _judge(self, step, loss, gnorm, scaler_on):
        self.seen.append((step, loss))
        return super()._judge(step, loss, gnorm, scaler_on)


class _LossLog(GAN):
    """Records which optimizer stepped at which global step, and the losses it saw."""

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        step_d = self.trainer.global_step  # the discriminator steps first
        super().training_step(batch, batch_idx)
        self.stepped += [("disc", step_d), ("gen", step_d + 1)]


@pytest.mark.parametrize("index, which", [(0, "gen"), (1, "disc")])
def test_the_guard_judges_one_optimizers_loss(tmp_path, index, which) -> None:
    pl.seed_everything(0)
    guard = _Recording(every_n_steps=2, optimizer_index=index)
    guard.seen = []
    model = _LossLog()
    model.stepped = []
    trainer = pl.Trainer(accelerator="cpu", max_steps=12, logger=False, callbacks=[guard], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=f"the loss judged is the one of optimizer {index}"):
        trainer.fit(model, DataLoader(TensorDataset(torch.randn(64, 6), torch.randint(0, 2, (64,))), batch_size=8))
    judged = {step for step, loss in guard.seen if loss is not None}
    # optimizer 0 is the generator's (configure_optimizers returns it first)
    assert judged == {step for name, step in model.stepped if name == which}
    assert {step for step, _ in guard.seen} == {step for _, step in model.stepped}  # every step's gradients checked


def test_an_optimizer_index_out_of_range_is_an_error(tmp_path) -> None:
    guard = DivergenceGuard(optimizer_index=2)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, callbacks=[guard], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match="optimizer_index=2"):
        trainer.fit(GAN(), DataLoader(TensorDataset(torch.randn(16, 6), torch.randint(0, 2, (16,))), batch_size=8))
