"""Every monitor's values reach ``trainer.callback_metrics``: Lightning's ``EarlyStopping`` and
``ModelCheckpoint`` on suite keys, with and without a validation loop, in real ``Trainer.fit`` runs."""

from __future__ import annotations

import csv
import math
import os
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from conftest import fit_ddp_spawn
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import (
    GradientNoiseScaleMonitor,
    GradientWeightAlignmentMonitor,
    Monitor,
    SpectralAlignmentMonitor,
)

GWA = "gwa/score"


# ---------------------------------------------------------------------- helpers
def _digits_loader(n: int = 400, batch_size: int = 50, shuffle: bool = True, seed: int = 0) -> DataLoader:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:n]
    ds = TensorDataset(torch.tensor(x[order.numpy()] / 16.0, dtype=torch.float32), torch.tensor(y[order.numpy()]))
    if not shuffle:  # (a loader holding a Generator cannot be sent to ddp_spawn ranks)
        return DataLoader(ds, batch_size=batch_size)
    return DataLoader(ds, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


class Digits(LightningModule):
    def __init__(self, lr: float = 0.3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.fc = nn.Linear(32, 10)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Seen(Callback):
    """What EarlyStopping / ModelCheckpoint read: ``key`` in callback_metrics at their hooks."""

    def __init__(self, *keys: str) -> None:
        self.keys = keys
        self.at_epoch_end: list[dict[str, Optional[float]]] = []
        self.at_val_end: list[dict[str, Optional[float]]] = []

    def _read(self, trainer) -> dict[str, Optional[float]]:
        out: dict[str, Optional[float]] = {"step": trainer.global_step}
        for k in self.keys:
            v = trainer.callback_metrics.get(k)
            out[k] = None if v is None else float(v)
        return out

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.at_epoch_end.append(self._read(trainer))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.at_val_end.append(self._read(trainer))


def _trainer(tmp_path, callbacks, max_epochs: int, logger: Any = False, **kw) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
        **kw,
    )


def _csv_series(log_dir: str, key: str) -> list[tuple[int, float]]:
    with open(os.path.join(log_dir, "metrics.csv")) as fh:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(fh) if r.get(key)]


def _gwa_stop_epoch(history: list[dict], warmup: int, patience: int) -> Optional[int]:
    """The epoch EarlyStopping(mode="max", patience) on the windowed scores stops at (None: never)."""
    best, wait = -math.inf, 0
    seen_any = False
    for rec in history:
        if rec["epoch"] < warmup:
            continue
        score = rec["score"]
        if score is not None and score > best:
            best, wait, seen_any = score, 0, True
        elif seen_any:  # an undefined epoch keeps the last value: no improvement
            wait += 1
            if wait >= patience:
                return rec["epoch"]
    return None


# ---------------------------------------------------------------------- the shared place
class _Probe(Monitor):
    name = "probe"


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[dict, int]] = []

    def log_metrics(self, metrics, step) -> None:
        self.calls.append((dict(metrics), step))


class _FakeTrainer:
    def __init__(self, rank: int) -> None:
        self.global_rank = rank
        self.loggers = [_Recorder()]
        self.callback_metrics: dict[str, torch.Tensor] = {}


@pytest.mark.parametrize("rank", [0, 1])
def test_log_metrics_publishes_on_every_rank(rank: int) -> None:
    trainer = _FakeTrainer(rank)
    probe = _Probe()
    metrics = {"probe/a": torch.tensor(2.5), "probe/b": 3, "probe/layer/c": torch.tensor([0.25], dtype=torch.float64)}
    host = probe.log_metrics(trainer, metrics, step=7, loggers_only=("probe/b",))
    assert host == {"probe/a": 2.5, "probe/b": 3.0, "probe/layer/c": 0.25}
    # loggers on rank 0 only, every key; callback_metrics on every rank, except loggers_only
    assert trainer.loggers[0].calls == ([(host, 7)] if rank == 0 else [])
    assert set(trainer.callback_metrics) == {"probe/a", "probe/layer/c"}
    for k, v in trainer.callback_metrics.items():
        assert isinstance(v, torch.Tensor) and v.shape == () and v.dtype == torch.float32 and v.device.type == "cpu"
        assert float(v) == host[k]
    # a later check updates its keys and leaves the others as they were
    probe.log_metrics(trainer, {"probe/a": 1.0}, step=8)
    assert float(trainer.callback_metrics["probe/a"]) == 1.0 and float(trainer.callback_metrics["probe/layer/c"]) == 0.25


class _ProgBarDigits(Digits):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, prog_bar=True)
        return loss


class _CountingProbe(Monitor):
    """Publishes a device tensor every other step; counts the host syncs made inside log_metrics."""

    name = "probe"

    def __init__(self) -> None:
        super().__init__(every_n_steps=2)
        self.syncs: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1
        if not self.is_due(step):
            return
        calls = []
        originals = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu")}

        def wrap(name):
            def wrapped(t, *a, **k):
                calls.append(name)
                return originals[name](t, *a, **k)

            return wrapped

        for n in originals:
            setattr(torch.Tensor, n, wrap(n))
        try:
            self.log_metrics(trainer, {"probe/w": pl_module.fc.weight.norm(), "probe/x": 1.0}, step)
        finally:
            for n, fn in originals.items():
                setattr(torch.Tensor, n, fn)
        self.syncs.append(len(calls))


def test_publishing_adds_no_host_sync_in_a_fit(tmp_path) -> None:
    """One transfer per check (the stack's .cpu and its .tolist), nothing for callback_metrics: the
    module's progress-bar values (converted with .item() when trainer.callback_metrics is read) stay."""
    probe = _CountingProbe()
    seen = Seen("probe/w", "probe/x", "loss")
    _trainer(tmp_path, [probe, seen], max_epochs=1, enable_checkpointing=False).fit(
        _ProgBarDigits(), _digits_loader(200)
    )
    assert probe.syncs == [2, 2]  # steps 0 and 2: .cpu() + .tolist() of the one stacked tensor
    assert seen.at_epoch_end[0]["probe/x"] == 1.0 and seen.at_epoch_end[0]["loss"] is not None


# ---------------------------------------------------------------------- gwa/score
@pytest.mark.parametrize("validation", [False, True], ids=["no_val", "val"])
def test_early_stopping_on_gwa_score_waits_through_warmup(tmp_path, validation: bool) -> None:
    """EarlyStopping(monitor="gwa/score", mode="max", strict=False) as documented: no -inf at the
    warm-up (the old placeholder stopped the run after epoch 0), stops by the same rule as stop=True."""
    torch.manual_seed(2)
    warmup, patience = 3, 2
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=warmup, log_histograms=False)
    es = EarlyStopping(monitor=GWA, mode="max", strict=False, patience=patience)
    seen = Seen(GWA)
    trainer = _trainer(tmp_path, [gwa, es, seen], max_epochs=30, enable_checkpointing=False)
    val = _digits_loader(200, shuffle=False, seed=1) if validation else None
    trainer.fit(Digits(), _digits_loader(), val)

    assert [v[GWA] for v in seen.at_epoch_end[:warmup]] == [None] * warmup  # absent, not -inf
    window = [r for r in gwa.history if r["epoch"] >= warmup]
    assert all(r["score"] is not None for r in window)
    assert [v[GWA] for v in seen.at_epoch_end[warmup:]] == pytest.approx([r["score"] for r in window], rel=1e-6)
    expected = _gwa_stop_epoch(gwa.history, warmup, patience)
    assert expected is not None, "the setup should plateau within 30 epochs"
    assert es.stopped_epoch == expected == gwa.best_epoch + patience
    assert trainer.current_epoch == expected + 1 < 30
    assert float(es.best_score) == pytest.approx(gwa.best_score, rel=1e-6)
    assert all(math.isfinite(v[GWA]) for v in seen.at_epoch_end if v[GWA] is not None)
    if validation:  # with a validation loop, the score at validation end is already this epoch's
        assert [v[GWA] for v in seen.at_val_end] == [v[GWA] for v in seen.at_epoch_end]


def test_early_stopping_on_gwa_score_as_written_without_warmup(tmp_path) -> None:
    """``EarlyStopping(monitor="gwa/score", mode="max")`` with Lightning's defaults (strict,
    check_finite) and ModelCheckpoint together, with a validation loop: no warm-up, no warning."""
    torch.manual_seed(3)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    es = EarlyStopping(monitor=GWA, mode="max")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor=GWA, mode="max", filename="{epoch}", save_top_k=-1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*gwa/score.*")
        trainer = _trainer(tmp_path, [gwa, es, ckpt], max_epochs=6)
        trainer.fit(Digits(), _digits_loader(), _digits_loader(200, shuffle=False, seed=1))
    assert len(gwa.history) == trainer.current_epoch
    for rec in gwa.history:  # each checkpoint carries its own epoch's score
        state = torch.load(tmp_path / "ck" / f"epoch={rec['epoch']}.ckpt", weights_only=False)
        assert float(state["callbacks"][ckpt.state_key]["current_score"]) == pytest.approx(rec["score"], rel=1e-6)
    assert os.path.basename(ckpt.best_model_path) == f"epoch={gwa.best_epoch}.ckpt"
    assert float(es.best_score) == pytest.approx(gwa.best_score, rel=1e-6)


def test_checkpoint_on_gwa_score_without_validation_skips_warmup(tmp_path) -> None:
    torch.manual_seed(4)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=2, log_histograms=False)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor=GWA, mode="max", filename="{epoch}", save_top_k=-1)
    _trainer(tmp_path, [gwa, ckpt], max_epochs=5).fit(Digits(), _digits_loader())
    # nothing saved for the warm-up epochs (no score, no placeholder); every windowed epoch with its score
    assert sorted(os.listdir(tmp_path / "ck")) == [f"epoch={e}.ckpt" for e in (2, 3, 4)]
    scores = {f"epoch={r['epoch']}.ckpt": r["score"] for r in gwa.history}
    for path, value in ckpt.best_k_models.items():
        assert float(value) == pytest.approx(scores[os.path.basename(path)], rel=1e-6)
    assert os.path.basename(ckpt.best_model_path) == f"epoch={gwa.best_epoch}.ckpt"


@pytest.mark.parametrize("key", [GWA, "gwa/selection"])
def test_consumers_that_fail_during_warmup_are_warned_about(tmp_path, key) -> None:
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=1, log_histograms=False)
    es = EarlyStopping(monitor=key, mode="max")  # strict=True: Lightning raises on the missing key
    with pytest.warns(UserWarning, match="strict=False"), pytest.raises(RuntimeError, match="not available"):
        _trainer(tmp_path, [gwa, es], max_epochs=3, enable_checkpointing=False).fit(Digits(), _digits_loader())
    # ModelCheckpoint with a validation loop: Lightning requires the key once validation has run
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=1, log_histograms=False)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor=key, mode="max")
    with pytest.warns(UserWarning, match="warmup_epochs=0"), pytest.raises(MisconfigurationException):
        _trainer(tmp_path, [gwa, ckpt], max_epochs=3).fit(
            Digits(), _digits_loader(), _digits_loader(100, shuffle=False, seed=1)
        )
    # the same with mask_warmup=False (every defined score published): works, and no warning
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=1, log_histograms=False, mask_warmup=False)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck2"), monitor=key, mode="max")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{key}.*")
        _trainer(tmp_path, [gwa, ckpt], max_epochs=2).fit(
            Digits(), _digits_loader(), _digits_loader(100, shuffle=False, seed=1)
        )
    assert ckpt.best_model_path


# ---------------------------------------------------------------------- step-level keys
SA_KEY, GNS_KEY = "sa/sign_diversity_mean", "gns/b_simple"


@pytest.mark.parametrize("validation", [False, True], ids=["no_val", "val"])
def test_step_level_keys_drive_early_stopping_and_checkpoint(tmp_path, validation: bool) -> None:
    from gpt import GPTModule, make_loader

    torch.manual_seed(0)
    module = GPTModule({"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32})  # conftest's tiny_gpt
    data = {"block_size": 32, "batch_size": 8, "n_chars": 20_000}  # a short corpus: 0.5 s, not 5 s
    loader = make_loader("prose", n_samples=8 * 6, **data)  # 6 optimizer steps per epoch
    val = make_loader("prose", n_samples=16, seed=100, shuffle=False, **data) if validation else None
    sa = SpectralAlignmentMonitor(every_n_steps=4)
    gns = GradientNoiseScaleMonitor(every_n_steps=5, per_layer=False)
    es = EarlyStopping(monitor="gns/batch_size", mode="max", patience=1)  # constant 8: stops after epoch 1
    es_sa = EarlyStopping(monitor=SA_KEY, mode="max", patience=100)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor=SA_KEY, mode="max", filename="{epoch}", save_top_k=-1)
    ckpt_gns = ModelCheckpoint(dirpath=str(tmp_path / "ck_gns"), monitor=GNS_KEY, mode="max", save_top_k=1)
    seen = Seen(SA_KEY, GNS_KEY, "gns/batch_size")
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = _trainer(tmp_path, [sa, gns, es, es_sa, ckpt, ckpt_gns, seen], max_epochs=5, logger=logger,
                       log_every_n_steps=1)
    trainer.fit(module, loader, val)

    assert es.stopped_epoch == 1 and float(es.best_score) == 8.0 and trainer.global_step == 12
    logged = {k: _csv_series(logger.log_dir, k) for k in (SA_KEY, GNS_KEY)}
    for when in [seen.at_epoch_end] + ([seen.at_val_end] if validation else []):
        assert len(when) == 2
        for rec in when:  # what the callbacks saw = the last value logged at or before that step
            for key, series in logged.items():
                last = [v for s, v in series if s < rec["step"]][-1]
                assert rec[key] == pytest.approx(last, rel=1e-6)
    # SA EarlyStopping tracked the best epoch-end value; each checkpoint holds the value it saw
    checked = seen.at_val_end if validation else seen.at_epoch_end
    assert float(es_sa.best_score) == pytest.approx(max(r[SA_KEY] for r in checked), rel=1e-6)
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    for epoch, rec in enumerate(checked):
        state = torch.load(tmp_path / "ck" / f"epoch={epoch}.ckpt", weights_only=False)
        assert float(state["callbacks"][ckpt.state_key]["current_score"]) == pytest.approx(rec[SA_KEY], rel=1e-6)
    assert float(ckpt_gns.best_model_score) == pytest.approx(max(r[GNS_KEY] for r in checked), rel=1e-6)


# ---------------------------------------------------------------------- DDP
class DumpCallbackMetrics(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        es = [c for c in trainer.callbacks if isinstance(c, EarlyStopping)]
        torch.save(
            {
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                "stopped": [c.stopped_epoch for c in es],
                "epoch": trainer.current_epoch,
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


def test_ddp_every_rank_gets_the_keys_and_decides_together(tmp_path) -> None:
    """Two ranks, EarlyStopping on gwa/score (reduced, the same on both ranks) and on a per-rank SA
    value: both reduce their decision across ranks, which would hang if a rank lacked the key."""
    torch.manual_seed(6)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=1, log_histograms=False)
    sa = SpectralAlignmentMonitor(every_n_steps=2)
    callbacks = [
        gwa,
        sa,
        EarlyStopping(monitor=GWA, mode="max", strict=False, patience=1),
        EarlyStopping(monitor=SA_KEY, mode="max", patience=50),
        DumpCallbackMetrics(str(tmp_path)),
    ]
    trainer = _trainer(tmp_path, callbacks, max_epochs=6, devices=2, strategy="ddp_spawn", enable_checkpointing=False)
    fit_ddp_spawn(trainer, Digits(lr=0.5), _digits_loader(400, shuffle=False))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert set(r0["metrics"]) == set(r1["metrics"]) >= {GWA, SA_KEY, "gwa/mean"}
    assert r0["metrics"][GWA] == r1["metrics"][GWA]  # reduced across ranks
    assert r0["stopped"] == r1["stopped"] and r0["epoch"] == r1["epoch"]


def test_unmasked_warmup_epochs_rank_below_the_window_for_a_checkpoint(tmp_path) -> None:
    # mask_warmup=False with a validation loop (the docs' way to checkpoint on gwa/selection there): the warm-up
    # epochs were published with their scores' values, and the checkpoint kept warm-up epoch 0 over GWA's own pick
    torch.manual_seed(4)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=2, log_histograms=False, mask_warmup=False)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="gwa/selection", mode="max", filename="{epoch}",
                           save_top_k=-1)
    _trainer(tmp_path, [gwa, ckpt], max_epochs=5).fit(Digits(), _digits_loader(),
                                                      _digits_loader(100, shuffle=False, seed=1))
    saved = {os.path.basename(p): float(v) for p, v in ckpt.best_k_models.items()}
    assert saved["epoch=0.ckpt"] == 0.0 and saved["epoch=1.ckpt"] == 0.0  # below every epoch of the window
    assert all(saved[f"epoch={e}.ckpt"] > 0.0 for e in (2, 3, 4))
    assert os.path.basename(ckpt.best_model_path) == f"epoch={gwa.best_epoch}.ckpt" and gwa.best_epoch >= 2
    assert all(math.isfinite(r["score"]) for r in gwa.history[:2])  # the warm-up epochs are still scored (and logged)
