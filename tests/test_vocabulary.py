"""One vocabulary across the suite: every deprecated argument name warns, maps to its new name, and
passing it together with the new name is an error (README, "One vocabulary")."""

from __future__ import annotations

import inspect
import warnings

import pytest

from lightning_monitor import (
    DivergenceGuard,
    GradientEarlyStopping,
    GradientNoiseScaleMonitor,
    GradientWeightAlignmentMonitor,
    SpectralAlignmentMonitor,
)

# (class, old name, new name, a value other than the default, the attribute holding the new name)
ALIASES = [
    (DivergenceGuard, "check_every_n_steps", "every_n_steps", 7, "every_n_steps"),
    (GradientNoiseScaleMonitor, "beta", "smoothing", 0.5, "smoothing"),
    (GradientWeightAlignmentMonitor, "histogram", "log_histograms", False, "log_histograms"),
    (GradientEarlyStopping, "components", "include", "*.attn.*", "include"),
]
IDS = [f"{cls.__name__}.{old}" for cls, old, *_ in ALIASES]


@pytest.mark.parametrize("cls,old,new,value,attr", ALIASES, ids=IDS)
def test_old_name_warns_and_maps(cls, old, new, value, attr):
    with pytest.warns(DeprecationWarning, match=rf"`{old}`.*deprecated.*`{new}`") as record:
        mon = cls(**{old: value})
    assert getattr(mon, attr) == value
    assert getattr(cls(**{new: value}), attr) == value
    # the warning points at the caller, not at the library
    assert any(r.filename == __file__ for r in record if issubclass(r.category, DeprecationWarning))


@pytest.mark.parametrize("cls,old,new,value,attr", ALIASES, ids=IDS)
def test_old_and_new_name_together_raise(cls, old, new, value, attr):
    with pytest.raises(ValueError, match=rf"`{new}`.*`{old}`"):
        cls(**{old: value, new: value})
    # also when the new name is the default value, passed explicitly
    default = inspect.signature(cls).parameters[new].default
    with pytest.raises(ValueError, match=rf"`{new}`.*`{old}`"):
        cls(**{old: value, new: default})


def test_new_name_by_position_and_old_by_keyword_raise():
    # GradientNoiseScaleMonitor(method, every_n_steps, warmup_steps, smoothing, ...)
    with pytest.raises(ValueError, match="`smoothing`.*`beta`"):
        GradientNoiseScaleMonitor("auto", 10, 0, 0.5, beta=0.5)


@pytest.mark.parametrize("cls,old,new,value,attr", ALIASES, ids=IDS)
def test_new_name_does_not_warn(cls, old, new, value, attr):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cls(**{new: value})


@pytest.mark.parametrize(
    "cls,old_attr,new_attr,kwargs",
    [
        (GradientNoiseScaleMonitor, "beta", "smoothing", {"smoothing": 0.5}),
        (GradientWeightAlignmentMonitor, "histogram", "log_histograms", {"log_histograms": False}),
        (GradientEarlyStopping, "component_patterns", "include", {"include": "*.mlp.*"}),
    ],
)
def test_old_attribute_reads_warn(cls, old_attr, new_attr, kwargs):
    mon = cls(**kwargs)
    with pytest.warns(DeprecationWarning, match=new_attr):
        assert getattr(mon, old_attr) == getattr(mon, new_attr)


def test_shared_names():
    """The shared ideas have one name on every monitor that has them."""
    monitors = [
        SpectralAlignmentMonitor, GradientNoiseScaleMonitor, GradientWeightAlignmentMonitor,
        GradientEarlyStopping, DivergenceGuard,
    ]
    params = {cls: set(inspect.signature(cls).parameters) for cls in monitors}
    for cls in monitors:
        assert {"every_n_steps", "warmup_steps"} <= params[cls], cls
        assert not {"check_every_n_steps", "beta", "histogram", "components"} & params[cls], cls
    for cls in (SpectralAlignmentMonitor, GradientNoiseScaleMonitor, GradientEarlyStopping):
        assert {"include", "exclude"} <= params[cls], cls
    for cls in (GradientNoiseScaleMonitor, GradientEarlyStopping, DivergenceGuard):
        assert "smoothing" in params[cls], cls
    for cls in (SpectralAlignmentMonitor, GradientWeightAlignmentMonitor):
        assert "log_histograms" in params[cls], cls
    # may the monitor act: `stop` on those that can stop the run, the guard's three-way `action`
    assert inspect.signature(GradientWeightAlignmentMonitor).parameters["stop"].default is False
    assert inspect.signature(GradientEarlyStopping).parameters["stop"].default is True
    assert inspect.signature(DivergenceGuard).parameters["action"].default == "rollback"
    for cls in (SpectralAlignmentMonitor, GradientNoiseScaleMonitor):
        assert "stop" not in params[cls] and "action" not in params[cls], cls


@pytest.mark.parametrize("stop", [True, False])
def test_grades_stop_decides_whether_it_stops(tmp_path, stop):
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Blocks(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    # tau huge: every component freezes at the first check after the grace period
    grades = GradientEarlyStopping(tau=1e6, threshold="absolute", grace_steps=0, every_n_steps=1, stop=stop)
    trainer = pl.Trainer(
        max_steps=6, callbacks=[grades], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(Blocks(), DataLoader(data, batch_size=8))
    assert grades.frozen_fraction == 1.0  # it freezes either way
    if stop:
        assert grades.stopped_at is not None and trainer.global_step < 6
    else:
        assert grades.stopped_at is None and trainer.global_step == 6
