"""GWA's histogram of the scores under ``Trainer(deterministic=True)``.

``torch.histc`` has no deterministic CUDA kernel: with ``torch.use_deterministic_algorithms(True)`` it raises on a
CUDA tensor, and GWA binned every scored step's scores with it. Here ``torch.histc`` is made to raise as it does there,
and the bins are checked against numpy on the per-sample oracle (the CUDA run itself is in ``tests/test_cuda.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tb_event_accumulator
from lightning.pytorch.loggers import TensorBoardLogger
from test_gwa_callback import DigitsMLP, _loader, _trainer

from lightning_monitor import GradientWeightAlignmentMonitor
from lightning_monitor.callbacks.gradient_weight_alignment import _bin_counts


def test_bin_counts_equal_histc_on_every_edge() -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        x = torch.cat([
            torch.rand(50_000, generator=g, dtype=torch.float64) * 2.4 - 1.2,  # a tenth outside [-1, 1]
            torch.linspace(-1.0, 1.0, 10_001, dtype=torch.float64),  # every bin edge, many times
            torch.tensor([-1.0, 1.0, 2.0, -2.0, float("inf"), -float("inf"), 1 - 1e-16, -1 + 1e-16]),
        ]).to(dtype)
        for bins in (1, 7, 100):
            expected = torch.histc(x, bins, -1.0, 1.0)
            got = _bin_counts(x, bins, -1.0, 1.0)
            assert got.dtype == x.dtype
            assert torch.equal(got, expected), (dtype, bins)


def _no_histc(*args, **kwargs):
    raise RuntimeError("histc_cuda does not have a deterministic implementation, but you set "
                       "'torch.use_deterministic_algorithms(True)'")


def test_scores_histogram_without_histc_in_a_deterministic_fit(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "histc", _no_histc)
    torch.manual_seed(0)
    model = DigitsMLP()
    loader, _ = _loader()
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = _trainer(tmp_path, logger, [gwa], max_epochs=3, deterministic=True)
    trainer.fit(model, loader)

    hist = tb_event_accumulator(logger.log_dir).Histograms("gwa/scores")
    assert len(hist) == 3
    edges = np.linspace(-1.0, 1.0, 101)
    for event, rec in zip(hist, gwa.history):
        oracle = torch.cat(model.oracle[rec["epoch"]]).numpy()
        counts = np.array(event.histogram_value.bucket)
        assert event.histogram_value.num == len(oracle) == 600
        assert counts.sum() == 600
        expected, _ = np.histogram(oracle, bins=edges)
        # the monitor's scores and the oracle's agree to ~1e-7: a sample on a bin edge may fall either side of it
        assert np.abs(counts - expected).sum() <= 2
        assert event.histogram_value.min == pytest.approx(oracle.min(), abs=1e-5)
        assert event.histogram_value.max == pytest.approx(oracle.max(), abs=1e-5)
