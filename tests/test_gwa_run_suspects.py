"""Suspects over the run (``gwa_suspects_run.csv``): the samples of the lowest mean alignment over the epochs
so far, each epoch weighted by the share of negative scores of the epoch before it (1 for the first), checked
against per-sample autograd (the module records cos(-dL_i/dW, W) per sample), across a resume, over 2 DDP ranks,
and with indices the training set does not have."""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_gwa_callback import DigitsMLP, RankDump, _loader, _trainer

from lightning_monitor import GradientWeightAlignmentMonitor
from lightning_monitor.callbacks.gradient_weight_alignment import RUN_SUSPECTS_FILENAME

K = 9


def _index(batch):  # a module-level function: ddp_spawn pickles the callbacks
    return batch[2]


def _rows(log_dir: str) -> list[dict]:
    with open(os.path.join(log_dir, RUN_SUSPECTS_FILENAME)) as fh:
        return list(csv.DictReader(fh))


def _weights(per_epoch: list[np.ndarray]) -> np.ndarray:
    """Each epoch's weight: 1 for the first, then the share of negative scores of the epoch before (floored)."""
    return np.array([1.0] + [max(float(np.mean(s < 0)), 1e-3) for s in per_epoch[:-1]])


def _oracle_lowest(per_epoch: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The K lowest per-sample weighted means over the epochs (samples in dataset order each epoch: shuffle=False)."""
    w = _weights(per_epoch)
    mean = (w[:, None] * np.stack(per_epoch)).sum(0) / w.sum()
    order = np.argsort(mean, kind="stable")[:K]
    return order, mean[order]


def _fit(root, epochs: int, ckpt_path=None, index_fn=lambda b: b[2]):
    seed_everything(0, verbose=False)
    module = DigitsMLP()
    loader, _ = _loader(shuffle=False)
    gwa = GradientWeightAlignmentMonitor(index_fn=index_fn, suspects=K, warmup_epochs=0, log_histograms=False)
    ckpt = ModelCheckpoint(dirpath=os.path.join(str(root), "ck"), save_top_k=-1)
    logger = CSVLogger(str(root), name="csv")
    trainer = _trainer(str(root), logger, [gwa, ckpt], max_epochs=epochs)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module, gwa


def test_run_suspects_are_the_lowest_mean_scores_over_the_epochs(tmp_path) -> None:
    trainer, module, _ = _fit(tmp_path, 3)
    per_epoch = [torch.cat(module.oracle[e]).numpy() for e in range(3)]
    index, mean = _oracle_lowest(per_epoch)
    rows = _rows(trainer.logger.log_dir)
    assert [int(r["epoch"]) for r in rows] == [2] * K  # rewritten each epoch: the last epoch's ranking
    assert [int(r["index"]) for r in rows] == index.tolist()
    np.testing.assert_allclose([float(r["mean_score"]) for r in rows], mean, rtol=1e-4, atol=1e-6)
    assert all(int(r["scored"]) == 3 for r in rows)
    # it differs from one epoch's list: the mean is a ranking of its own
    last = np.argsort(per_epoch[-1], kind="stable")[:K]
    assert set(last.tolist()) != set(index.tolist())
    # the weights are not all equal here (else this checks the plain mean only)
    w = _weights(per_epoch)
    assert w[1:].max() < 0.9 * w[0]


def test_epochs_after_memorisation_count_less(tmp_path) -> None:
    """Scores whose epoch followed one with few negative scores count in proportion: a sample negative only in an
    early, contested epoch stays ranked above one negative only late, after the others were fit."""
    import torch as t

    from lightning_monitor.functional.gwa import SampleMeans

    m = SampleMeans(2)
    m.add(t.tensor([0, 1]), t.tensor([-0.5, 0.1], dtype=t.float64), weight=1.0)  # contested epoch: sample 0 resists
    m.add(t.tensor([0, 1]), t.tensor([0.1, -0.5], dtype=t.float64), weight=0.02)  # late: sample 1 dips
    mean, index, count = SampleMeans.lowest(m.packed(), 2)
    assert index.tolist() == [0, 1] and count.tolist() == [2.0, 2.0]
    np.testing.assert_allclose(mean.tolist(), [(-0.5 + 0.02 * 0.1) / 1.02, (0.1 - 0.02 * 0.5) / 1.02])
    # a checkpoint of the earlier layout (sums and counts) loads as weight 1 everywhere
    old = SampleMeans(2)
    old.load(t.tensor([[1.0, -2.0], [2.0, 4.0]], dtype=t.float64))
    assert SampleMeans.lowest(old.packed(), 2)[0].tolist() == [-0.5, 0.5]


def test_run_suspects_continue_across_a_resume(tmp_path) -> None:
    _, first, _ = _fit(tmp_path / "a", 2)
    ckpt = os.path.join(str(tmp_path / "a"), "ck", "epoch=1-step=12.ckpt")
    trainer, resumed, _ = _fit(tmp_path / "a", 3, ckpt_path=ckpt)
    per_epoch = [torch.cat(first.oracle[e]).numpy() for e in (0, 1)] + [torch.cat(resumed.oracle[2]).numpy()]
    index, mean = _oracle_lowest(per_epoch)
    rows = _rows(trainer.logger.log_dir)
    assert [int(r["index"]) for r in rows] == index.tolist()
    np.testing.assert_allclose([float(r["mean_score"]) for r in rows], mean, rtol=1e-4, atol=1e-6)
    assert all(int(r["scored"]) == 3 for r in rows)  # the two epochs before the resume count too


def test_indices_outside_the_training_set_are_left_out_and_said(tmp_path) -> None:
    with pytest.warns(UserWarning, match="outside \\[0, 600\\)"):
        trainer, _, _ = _fit(tmp_path, 1, index_fn=lambda b: torch.where(b[2] < 300, b[2], b[2] + 1000))
    rows = _rows(trainer.logger.log_dir)
    assert rows and all(int(r["index"]) < 300 for r in rows)


def test_off_without_index_fn_or_when_asked(tmp_path) -> None:
    seed_everything(0, verbose=False)
    loader, _ = _loader(shuffle=False)
    for kwargs in ({}, {"index_fn": lambda b: b[2], "run_suspects": False}):
        logger = CSVLogger(str(tmp_path), name="off")
        gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False, **kwargs)
        trainer = _trainer(str(tmp_path), logger, [gwa], max_epochs=1, enable_checkpointing=False)
        trainer.fit(DigitsMLP(record=False), loader)
        assert gwa._run is None and not os.path.exists(os.path.join(logger.log_dir, RUN_SUSPECTS_FILENAME))


@pytest.mark.slow
def test_ddp_run_suspects_are_reduced_over_ranks(tmp_path) -> None:
    from conftest import fit_ddp_spawn

    from lightning_monitor.callbacks.gradient_weight_alignment import SUSPECTS_FILENAME

    torch.manual_seed(5)
    n = 400
    loader, _ = _loader(n, batch_size=50, shuffle=False)
    # every sample is a suspect: the per-epoch file then holds each sample's score of each epoch, by index
    gwa = GradientWeightAlignmentMonitor(index_fn=_index, suspects=n, warmup_epochs=0, log_histograms=False)
    logger = CSVLogger(str(tmp_path), name="ddp")
    trainer = _trainer(tmp_path, logger, [gwa, RankDump(str(tmp_path))], max_epochs=3, devices=2,
                       strategy="ddp_spawn", enable_checkpointing=False)
    fit_ddp_spawn(trainer, DigitsMLP(lr=0.5), loader)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    log_dir = os.path.join(str(tmp_path), "ddp", "version_0")
    with open(os.path.join(log_dir, SUSPECTS_FILENAME)) as fh:
        per_epoch = list(csv.DictReader(fh))
    by_index: dict[int, list[float]] = {}
    for e in range(3):
        rows = [r for r in per_epoch if int(r["epoch"]) == e]
        # the epoch's scores are both ranks' autograd scores (the sampler's order changes between epochs, so
        # they are compared as sets of values)
        oracle = np.sort(np.concatenate([r["oracle"][e].numpy() for r in ranks]))
        np.testing.assert_allclose(np.sort([float(r["score"]) for r in rows]), oracle, rtol=1e-4, atol=1e-6)
        assert sorted(int(r["index"]) for r in rows) == list(range(n))
        for r in rows:
            by_index.setdefault(int(r["index"]), []).append(float(r["score"]))
    # each epoch's weight from its predecessor's share of negative scores over both ranks
    w = _weights([np.concatenate([r["oracle"][e].numpy() for r in ranks]) for e in range(3)])
    expected = sorted((float(np.dot(w, v) / w.sum()), i) for i, v in by_index.items())
    run = _rows(log_dir)
    assert len(run) == n and all(int(r["scored"]) == 3 for r in run)
    np.testing.assert_allclose([float(r["mean_score"]) for r in run], [m for m, _ in expected], rtol=1e-4, atol=1e-6)
    assert [int(r["index"]) for r in run[:K]] == [i for _, i in expected[:K]]


class _Smoothed(DigitsMLP):
    """Trained with label smoothing 0.1; its oracle stays each sample's alignment against its own label
    (cos(-dL_i/dW, W) of the plain cross-entropy)."""

    def training_step(self, batch, batch_idx):
        from torch.func import functional_call, grad, vmap

        x, y = batch[0], batch[1]
        z = self.body(x)
        logits = self.fc(z)  # the head's call of the step, before the oracle's own calls
        params = {k: v.detach() for k, v in self.fc.named_parameters()}

        def loss(p, zi, yi):
            return torch.nn.functional.cross_entropy(functional_call(self.fc, p, (zi[None],)), yi[None])

        g = -vmap(grad(loss), in_dims=(None, 0, 0))(params, z.detach(), y)["weight"].flatten(1).double()
        w = self.fc.weight.detach().flatten().double()
        self.oracle.setdefault(self.current_epoch, []).append((g @ w) / (g.norm(dim=1) * w.norm()))
        return torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.1)


def test_with_label_smoothing_the_suspects_are_ranked_against_their_own_labels(tmp_path) -> None:
    # against the smoothed target every confidently fitted sample scores below 0, and the lists held clean, correctly
    # predicted samples (precision 0.12 at 20% flipped labels on generated data, 0.97 without smoothing)
    from test_gwa_callback import _digits
    from torch.utils.data import DataLoader, TensorDataset

    seed_everything(0, verbose=False)
    x, y, flipped = _digits(600, flip=0.2)
    loader = DataLoader(TensorDataset(x, y, torch.arange(600)), batch_size=100, shuffle=False)
    module = _Smoothed(lr=0.5)
    gwa = GradientWeightAlignmentMonitor(index_fn=_index, suspects=60, warmup_epochs=0, log_histograms=False)
    logger = CSVLogger(str(tmp_path), name="csv")
    _trainer(str(tmp_path), logger, [gwa], max_epochs=20).fit(module, loader)
    assert gwa._label_smoothing == pytest.approx(0.1, rel=1e-3)  # measured, and the logged score is the loss's
    last = torch.cat(module.oracle[19]).numpy()
    with open(os.path.join(logger.log_dir, "gwa_suspects.csv")) as fh:
        rows = [r for r in csv.DictReader(fh) if r["epoch"] == "19"]
    order = np.argsort(last, kind="stable")[:60]
    assert [int(r["index"]) for r in rows] == order.tolist()
    np.testing.assert_allclose([float(r["score"]) for r in rows], last[order], rtol=1e-4, atol=1e-6)
    listed = [int(r["index"]) for r in _rows(logger.log_dir)]
    assert len(listed) == 60 and float(flipped[listed].float().mean()) >= 0.9
