"""GradientWeightAlignmentMonitor in real Trainer.fit runs, checked against per-sample autograd."""

from __future__ import annotations

import csv
import json
import math
import os
import warnings

import numpy as np
import pytest
import scipy.stats
import torch
import torch.nn.functional as F
from conftest import tb_event_accumulator, tb_scalars
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import GradientWeightAlignmentMonitor
from lightning_monitor.callbacks.gradient_weight_alignment import SUSPECTS_FILENAME
from lightning_monitor.report import load_run, summarize
from conftest import fit_ddp_spawn  # noqa: E402


def _digits(n: int = 600, flip: float = 0.0, seed: int = 0):
    x, y = load_digits(return_X_y=True)
    g = np.random.default_rng(seed)
    order = g.permutation(len(y))[:n]
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order])
    flipped = torch.zeros(n, dtype=torch.bool)
    if flip:
        k = int(flip * n)
        which = torch.from_numpy(g.choice(n, k, replace=False))
        y[which] = (y[which] + torch.from_numpy(g.integers(1, 10, k))) % 10
        flipped[which] = True
    return x, y, flipped


class DigitsMLP(LightningModule):
    """An MLP that also records, per sample, the autograd alignment cos(-dL_i/dW, W) of its head."""

    def __init__(self, lr: float = 0.1, record: bool = True, val: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.fc = nn.Linear(32, 10)
        self.lr = lr
        self.record = record
        self.val = val
        self.oracle: dict[int, list[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        z = self.body(x)
        logits = self.fc(z)
        if self.record:
            params = {k: v.detach() for k, v in self.fc.named_parameters()}

            def loss(p, zi, yi):
                return F.cross_entropy(functional_call(self.fc, p, (zi[None],)), yi[None])

            g = -vmap(grad(loss), in_dims=(None, 0, 0))(params, z.detach(), y)["weight"].flatten(1).double()
            w = self.fc.weight.detach().flatten().double()
            self.oracle.setdefault(self.current_epoch, []).append((g @ w) / (g.norm(dim=1) * w.norm()))
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _loader(n: int = 600, batch_size: int = 100, flip: float = 0.0, shuffle: bool = True, **kw):
    x, y, flipped = _digits(n, flip)
    ds = TensorDataset(x, y, torch.arange(n))
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, **kw), flipped


def _trainer(tmp_path, logger, callbacks, max_epochs: int, **kw) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **kw,
    )


def _scipy_gwa(x: np.ndarray) -> float:
    return float(np.mean(x) / (scipy.stats.kurtosis(x, fisher=True, bias=True) + 1.2))


def test_fit_logs_oracle_score_and_checkpoint_keeps_gwa_best(tmp_path) -> None:
    torch.manual_seed(0)
    model = DigitsMLP()
    loader, _ = _loader()
    gwa = GradientWeightAlignmentMonitor(index_fn=lambda b: b[2], suspects=7, warmup_epochs=1)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="gwa/score", mode="max", filename="{epoch}")
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = _trainer(tmp_path, logger, [gwa, ckpt], max_epochs=6)
    trainer.fit(model, loader)

    assert gwa._head_name == "fc"
    scalars = tb_scalars(logger.log_dir)
    logged = dict((step, v) for step, v in scalars["gwa/score"])
    assert len(gwa.history) == 6 and len(logged) == 6
    for rec in gwa.history:
        oracle = torch.cat(model.oracle[rec["epoch"]]).numpy()
        assert rec["count"] == len(oracle) == 600
        assert rec["score"] == pytest.approx(_scipy_gwa(oracle), rel=1e-4, abs=1e-6)
        assert logged[rec["step"]] == pytest.approx(rec["score"], rel=1e-5)
        assert rec["negative"] == int((oracle < 0).sum())
    kurt = dict(scalars["gwa/kurtosis"])
    first = gwa.history[0]
    oracle0 = torch.cat(model.oracle[0]).numpy()
    assert kurt[first["step"]] == pytest.approx(scipy.stats.kurtosis(oracle0, bias=True), rel=1e-4)
    for key in ("gwa/mean", "gwa/negative", "gwa/negative_fraction", "gwa/best_epoch"):
        assert key in scalars
    assert all(math.isfinite(v) for tag in scalars for _, v in scalars[tag])
    ea = tb_event_accumulator(logger.log_dir)
    hist = ea.Histograms("gwa/scores")
    assert len(hist) == 6 and hist[0].histogram_value.num == 600

    # best epoch: max score after the 1-epoch warm-up; ModelCheckpoint kept exactly that one
    window = [r for r in gwa.history if r["epoch"] >= 1]
    best = max(window, key=lambda r: r["score"])
    assert gwa.best_epoch == best["epoch"]
    assert os.path.basename(ckpt.best_model_path) == f"epoch={best['epoch']}.ckpt"
    assert float(ckpt.best_model_score) == pytest.approx(best["score"], rel=1e-5)

    # suspects: the 7 most negative oracle scores of each epoch, with their dataset indices
    with open(os.path.join(logger.log_dir, SUSPECTS_FILENAME)) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 7 * 6
    last = gwa.history[-1]["epoch"]
    mine = sorted((float(r["score"]), int(r["index"])) for r in rows if int(r["epoch"]) == last)
    # which dataset index each oracle score belongs to is not recorded by the module, so compare values
    oracle = np.sort(torch.cat(model.oracle[last]).numpy())[:7]
    np.testing.assert_allclose([s for s, _ in mine], oracle, rtol=1e-4, atol=1e-6)
    assert len({i for _, i in mine}) == 7 and all(0 <= i < 600 for _, i in mine)


def test_checkpoint_with_validation_loop_sees_this_epochs_score(tmp_path) -> None:
    """With a validation loop ModelCheckpoint saves at validation end, before on_train_epoch_end:
    the score must already be this epoch's, not the previous one's."""
    torch.manual_seed(1)
    model = DigitsMLP(record=False)
    loader, _ = _loader()
    val, _ = _loader(200, shuffle=False)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    ckpt = ModelCheckpoint(
        dirpath=str(tmp_path / "ckpt"), monitor="gwa/score", mode="max", filename="{epoch}", save_top_k=-1
    )
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = _trainer(tmp_path, csv_logger, [gwa, ckpt], max_epochs=4, num_sanity_val_steps=0)
    trainer.fit(model, loader, val)
    assert [rec["count"] for rec in gwa.history] == [600] * 4  # validation forwards are not scored
    for rec in gwa.history:
        state = torch.load(tmp_path / "ckpt" / f"epoch={rec['epoch']}.ckpt", weights_only=False)
        saved = state["callbacks"][ckpt.state_key]["current_score"]
        assert float(saved) == pytest.approx(rec["score"], rel=1e-5)
    assert os.path.basename(ckpt.best_model_path) == f"epoch={gwa.best_epoch}.ckpt"
    # CSVLogger got every key, and no NaN anywhere
    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as fh:
        rows = list(csv.DictReader(fh))
    scores = [float(r["gwa/score"]) for r in rows if r.get("gwa/score")]
    assert scores == pytest.approx([r["score"] for r in gwa.history], rel=1e-5)
    for r in rows:
        for k, v in r.items():
            if k.startswith("gwa/") and v:
                assert math.isfinite(float(v))


class SeenScores(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        value = trainer.callback_metrics.get("gwa/score")
        self.values.append(None if value is None else float(value))


def test_warmup_masks_checkpoint_and_early_stopping_stops(tmp_path) -> None:
    torch.manual_seed(2)
    model = DigitsMLP(record=False, lr=0.3)
    loader, _ = _loader(400, batch_size=50)
    gwa = GradientWeightAlignmentMonitor(stop=True, patience=2, warmup_fraction=0.1, log_histograms=False)
    seen = SeenScores()
    trainer = _trainer(tmp_path, TensorBoardLogger(str(tmp_path), name="tb"), [gwa, seen], max_epochs=30)
    trainer.fit(model, loader)
    # what checkpoint callbacks see: no key during the warm-up (no placeholder), the epoch's own score after it
    assert seen.values[:3] == [None] * 3
    assert seen.values[3:] == pytest.approx([r["score"] for r in gwa.history[3:]], rel=1e-5)
    assert gwa._warmup_resolved == 3  # ceil(10% of 30)
    assert gwa.stopped_epoch is not None and trainer.current_epoch < 29
    scores = {r["epoch"]: r["score"] for r in gwa.history}
    assert gwa.best_epoch >= 3 and gwa.best_score == max(s for e, s in scores.items() if e >= 3)
    assert gwa.stopped_epoch == gwa.best_epoch + gwa.patience
    assert all(not r["eligible"] for r in gwa.history if r["epoch"] < 3)
    alerts = [json.loads(line) for line in open(os.path.join(trainer.logger.log_dir, "alerts.jsonl"))]
    stop = [a for a in alerts if a["kind"] == "early_stop"]
    assert len(stop) == 1 and f"best epoch {gwa.best_epoch}" in stop[0]["message"]
    # a resumed callback continues from the same selection state
    fresh = GradientWeightAlignmentMonitor(stop=True, patience=2)
    fresh.load_state_dict(gwa.state_dict())
    assert (fresh.best_epoch, fresh.best_score, fresh.wait, fresh.history) == (
        gwa.best_epoch,
        gwa.best_score,
        gwa.wait,
        gwa.history,
    )


def test_selection_rule_scratch_and_finetune() -> None:
    series = [0.9, 0.5, 0.3, 0.4, 0.7, 0.6, 0.8, 0.2]
    scratch = GradientWeightAlignmentMonitor(warmup_epochs=1)
    scratch._warmup_resolved = 1
    tune = GradientWeightAlignmentMonitor(warmup_epochs=0, finetune=True)
    elig_s = [scratch._select(e, s) for e, s in enumerate(series)]
    elig_t = [tune._select(e, s) for e, s in enumerate(series)]
    assert elig_s == [False] + [True] * 7 and scratch.best_epoch == 6  # 0.9 at epoch 0 is warm-up
    assert tune.dip_epoch == 2 and elig_t == [False] * 3 + [True] * 5 and tune.best_epoch == 6
    assert tune.wait == 1
    # an undefined epoch (None) inside the dip: the minimum is the last defined epoch before the rise
    gap = GradientWeightAlignmentMonitor(warmup_epochs=0, finetune=True)
    for e, sc in enumerate([0.9, 0.5, None, 0.7]):
        gap._select(e, sc)
    assert gap.dip_epoch == 1 and gap.best_epoch == 3
    plain = GradientWeightAlignmentMonitor(warmup_epochs=0)
    plain._warmup_resolved = 0
    for e, s in enumerate(series):
        plain._select(e, s)
    assert plain.best_epoch == 0  # without warm-up / dip the initial high wins: why the rules exist


class TinyLM(LightningModule):
    def __init__(self, vocab: int = 11, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)

    def training_step(self, batch, batch_idx):
        x, y = batch["input_ids"], batch["labels"]
        logits = self.out(torch.tanh(self.proj(self.emb(x))))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _DictDS(torch.utils.data.Dataset):
    def __init__(self, n: int = 24, t: int = 6) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 11, (n, t), generator=g)
        self.y = torch.roll(self.x, -1, 1)
        self.y[:, -2:] = -100  # ignored tokens

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i], "index": i}


def test_sequence_tokens_are_samples_and_ignored_tokens_skipped(tmp_path) -> None:
    torch.manual_seed(3)
    gwa = GradientWeightAlignmentMonitor(index_fn=lambda b: b["index"], suspects=5, warmup_epochs=0)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = _trainer(tmp_path, logger, [gwa], max_epochs=2)
    trainer.fit(TinyLM(), DataLoader(_DictDS(), batch_size=8))
    assert gwa._head_name == "out"
    assert [r["count"] for r in gwa.history] == [24 * 4] * 2  # 6 tokens, 2 ignored
    with open(os.path.join(logger.log_dir, SUSPECTS_FILENAME)) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 10 and all(0 <= int(r["position"]) < 4 for r in rows)


def test_gpt_example_lm_head_found(tmp_path, tiny_gpt) -> None:
    module, loader = tiny_gpt(batch_size=4, n_samples=32)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    trainer = _trainer(tmp_path, CSVLogger(str(tmp_path)), [gwa], max_epochs=1, limit_train_batches=3)
    trainer.fit(module, loader)
    assert gwa._head_name == "model.lm_head"
    assert gwa.history[0]["count"] == 3 * 4 * 32 and math.isfinite(gwa.history[0]["score"])


# ---------------------------------------------------------------------- bad input
class NoLinear(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 3, 1)

    def training_step(self, batch, batch_idx):
        return self.conv(batch[0][:, None, :3]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_bad_constructor_and_setup_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="warmup_fraction"):
        GradientWeightAlignmentMonitor(warmup_fraction=1.5)
    with pytest.raises(ValueError, match="patience"):
        GradientWeightAlignmentMonitor(patience=0)
    with pytest.raises(TypeError, match="index_fn"):
        GradientWeightAlignmentMonitor(index_fn=3)
    loader, _ = _loader(100)
    cases = [
        (NoLinear(), {}, "no nn.Linear"),
        (DigitsMLP(record=False), {"head": "fcc"}, "names no module"),
        (DigitsMLP(record=False), {"head": "body"}, "is a Sequential"),
    ]
    for model, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            _trainer(tmp_path, False, [GradientWeightAlignmentMonitor(**kw)], max_epochs=1).fit(model, loader)
    with pytest.raises(ValueError, match="warmup_epochs"):  # an endless run has no 10%
        _trainer(tmp_path, False, [GradientWeightAlignmentMonitor()], max_epochs=-1).fit(
            DigitsMLP(record=False), loader
        )
    # max_steps instead of max_epochs: 10% of the planned epochs (40 steps of 4 per epoch = 10 epochs)
    gwa = GradientWeightAlignmentMonitor(log_histograms=False)
    _trainer(tmp_path, False, [gwa], max_epochs=-1, max_steps=40).fit(
        DigitsMLP(record=False), _loader(100, batch_size=25)[0]
    )
    assert gwa._warmup_resolved == 1 and len(gwa.history) == 10


@pytest.mark.parametrize(
    "target_fn, err, match",
    [
        (lambda b: b[1][:-1], ValueError, "one target per logits row"),
        (lambda b: b[1].float(), ValueError, "floating-point targets"),
        (lambda b: b[1] + 5, ValueError, r"outside \[0, 10\)"),
        (lambda b: F.one_hot(b[1], 10).float() * 2, ValueError, "not probabilities"),
        (lambda b: b[1].tolist(), TypeError, "must return a Tensor"),
    ],
)
def test_bad_targets_are_named(tmp_path, target_fn, err, match) -> None:
    loader, _ = _loader(100)
    gwa = GradientWeightAlignmentMonitor(target_fn=target_fn)
    with pytest.raises(err, match=match):
        _trainer(tmp_path, False, [gwa], max_epochs=1).fit(DigitsMLP(record=False), loader)


def test_default_target_fn_rejects_unknown_batch(tmp_path) -> None:
    from lightning_monitor.callbacks.gradient_weight_alignment import default_target_fn

    assert default_target_fn({"labels": 1}) == 1
    with pytest.raises(TypeError, match="target_fn"):
        default_target_fn({"x": 1})


def test_time_series_classifier_targets_are_found(tmp_path) -> None:
    """Hugging Face's time-series classifiers (PatchTST, PatchTSMixer) take their class targets as
    ``target_values``: GWA read none of its keys there and stayed idle (`nothing_to_watch`) on a softmax head."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.PatchTSTConfig(num_input_channels=2, context_length=32, patch_length=8, patch_stride=8,
                                         d_model=16, num_attention_heads=2, num_hidden_layers=1, ffn_dim=32,
                                         num_targets=3)

    class TS(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.PatchTSTForClassification(config)

        def training_step(self, batch, batch_idx):
            return self.model(past_values=batch["past_values"], target_values=batch["target_values"]).loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    x = torch.randn(96, 32, 2)
    data = [{"past_values": x[i], "target_values": x[i, :, 0].mean().gt(0).long() + x[i, 0, 1].gt(1).long()}
            for i in range(len(x))]
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    _trainer(tmp_path, False, [gwa], max_epochs=2).fit(TS(), DataLoader(data, batch_size=16))
    assert gwa.idle_reason is None and gwa._head_name == "model.head.linear"
    assert [h["count"] for h in gwa.history] == [96, 96]


def test_soft_targets_and_too_few_samples(tmp_path) -> None:
    loader, _ = _loader(100, batch_size=50)
    soft = GradientWeightAlignmentMonitor(
        target_fn=lambda b: F.one_hot(b[1], 10).float() * 0.9 + 0.01,
        warmup_epochs=0,
        index_fn=lambda b: b[2],
        suspects=3,
    )
    logger = CSVLogger(str(tmp_path), name="soft")
    _trainer(tmp_path, logger, [soft], max_epochs=1).fit(DigitsMLP(record=False), loader)
    assert soft.history[0]["count"] == 100 and math.isfinite(soft.history[0]["score"])
    with open(os.path.join(logger.log_dir, SUSPECTS_FILENAME)) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 and all(r["target"] == "" and r["position"] == "" for r in rows)
    # suspects=0 with an index_fn: nothing kept, nothing written
    none = GradientWeightAlignmentMonitor(warmup_epochs=0, index_fn=lambda b: b[2], suspects=0)
    _trainer(tmp_path, False, [none], max_epochs=1).fit(DigitsMLP(record=False), loader)
    assert math.isfinite(none.history[0]["score"])

    tiny, _ = _loader(3, batch_size=3)
    few = GradientWeightAlignmentMonitor(warmup_epochs=0)
    logger = CSVLogger(str(tmp_path), name="few")
    with pytest.warns(UserWarning, match="3 < 4 samples"):
        _trainer(tmp_path, logger, [few], max_epochs=2).fit(DigitsMLP(record=False), tiny)
    assert [r["score"] for r in few.history] == [None, None]
    path = os.path.join(logger.log_dir, "metrics.csv")
    assert not os.path.exists(path) or "gwa/score" not in open(path).read()


class SkipsBatches(DigitsMLP):
    """Returns None from `training_step` for every third batch (Lightning's documented way to skip one), before or
    after the forward."""

    def __init__(self, forward_first: bool) -> None:
        super().__init__(record=False)
        self.forward_first = forward_first

    def training_step(self, batch, batch_idx):
        if batch_idx % 3 == 1:
            if self.forward_first:
                self(batch[0])
            return None
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("forward_first", [False, True])
def test_a_batch_skipped_by_returning_none_is_not_blamed_on_the_head(tmp_path, forward_first) -> None:
    # a skipped batch was said as "head `net.2` was not called in a training step ... Pass `head=`", of the right head
    loader, _ = _loader(300, batch_size=50)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, False, [gwa], max_epochs=2).fit(SkipsBatches(forward_first), loader)
    assert not [str(w.message) for w in caught if "GradientWeightAlignment" in str(w.message)]
    # the 4 batches of 6 that trained; with the forward run before the skip, the head's output was scored as it ran
    assert [h["count"] for h in gwa.history] == ([300, 300] if forward_first else [200, 200])


class UnusedLast(DigitsMLP):
    def __init__(self) -> None:
        super().__init__(record=False)
        self.aux = nn.Linear(10, 10)  # registered last, never called: the default head pick is wrong


def test_head_never_called_warns_and_logs_nothing(tmp_path) -> None:
    loader, _ = _loader(100, batch_size=50)
    gwa = GradientWeightAlignmentMonitor(head="aux", warmup_epochs=0)
    model = UnusedLast()
    with pytest.warns(UserWarning) as record:
        _trainer(tmp_path, False, [gwa], max_epochs=1).fit(model, loader)
    messages = " ".join(str(w.message) for w in record)
    assert "`aux` was not called" in messages and "0 < 4 samples" in messages
    assert gwa.history[0]["score"] is None and not model.aux._forward_hooks  # the hook was removed


def test_the_head_is_the_linear_whose_output_the_model_returns(tmp_path) -> None:
    # without `head=`, the last nn.Linear with >= 2 outputs registered was taken: here `aux`, never called, and
    # nothing was scored; the first training forward now shows that `fc`'s output is what the model returns
    loader, _ = _loader(100, batch_size=50, shuffle=False)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    torch.manual_seed(0)
    model = UnusedLast()
    _trainer(tmp_path, False, [gwa], max_epochs=1).fit(model, loader)
    assert gwa._head_name == "fc" and gwa.history[0]["count"] == 100  # the first batch (the watched one) counts
    assert not model.aux._forward_hooks and not model.fc._forward_hooks  # every watching hook removed
    ok = GradientWeightAlignmentMonitor(head="fc", warmup_epochs=0)
    torch.manual_seed(0)
    _trainer(tmp_path, False, [ok], max_epochs=1).fit(UnusedLast(), loader)
    assert ok.history[0]["score"] == pytest.approx(gwa.history[0]["score"], rel=1e-6)


class AuxAfter(nn.Module):
    """The classifier registered first, then an auxiliary projection called after it and not returned (a
    contrastive or regulariser term the training step adds)."""

    def __init__(self) -> None:
        super().__init__()
        self.decision = nn.Linear(32, 10)
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)
        logits = self.decision(z)
        self.aux = self.proj(z).pow(2).mean()
        return logits


class AuxModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = AuxAfter()

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        return F.cross_entropy(self.model(x), y) + 1e-3 * self.model.aux

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_an_auxiliary_projection_registered_last_is_not_taken_for_the_head(tmp_path) -> None:
    loader, _ = _loader(100, batch_size=50)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, every_n_steps=1)
    _trainer(tmp_path, False, [gwa], max_epochs=2).fit(AuxModule(), loader)
    assert gwa._head_name == "model.decision"
    assert [h["count"] for h in gwa.history] == [100, 100]


class HookedSteps(DigitsMLP):
    """Records, per training step, whether the head carries a forward hook during its forward."""

    def __init__(self) -> None:
        super().__init__(record=False)
        self.hooked: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.hooked.append(bool(self.fc._forward_hooks))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("every, accumulate", [(1, 1), (3, 1), (2, 2)])
def test_head_hook_is_armed_on_due_steps_only_and_removed_after(tmp_path, every, accumulate) -> None:
    loader, _ = _loader(400, batch_size=50)  # 8 batches an epoch
    model = HookedSteps()
    gwa = GradientWeightAlignmentMonitor(every_n_steps=every, warmup_epochs=0, log_histograms=False)
    _trainer(tmp_path, False, [gwa], max_epochs=2, accumulate_grad_batches=accumulate).fit(model, loader)
    # every (micro-)batch of a due optimizer step is scored, nothing else: batch j runs at step j // accumulate
    expected = [(j // accumulate) % every == 0 for j in range(16)]
    assert model.hooked == expected
    assert [h["count"] for h in gwa.history] == [50 * sum(expected[:8]), 50 * sum(expected[8:])]
    assert not model.fc._forward_hooks


class LateHead(LightningModule):
    """Manual optimization whose classifier head runs only after a first optimizer step of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Linear(64, 32)
        self.fc = nn.Linear(32, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        opt_body, opt_fc = self.optimizers()
        opt_body.zero_grad()
        self.manual_backward(self.body(x).pow(2).mean())
        opt_body.step()
        opt_fc.zero_grad()
        self.manual_backward(F.cross_entropy(self.fc(torch.relu(self.body(x)).detach()), y))
        opt_fc.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.body.parameters(), lr=0.01), torch.optim.SGD(self.fc.parameters(), lr=0.01)


@pytest.mark.parametrize("every", [1, 2])
def test_a_head_run_after_a_first_optimizer_step_is_scored(tmp_path, every) -> None:
    loader, _ = _loader(200, batch_size=50)
    model = LateHead()
    gwa = GradientWeightAlignmentMonitor(head="fc", every_n_steps=every, warmup_epochs=0, log_histograms=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*was not called")
        _trainer(tmp_path, False, [gwa], max_epochs=1).fit(model, loader)
    assert gwa.history[0]["count"] == 200  # two optimizer steps a batch: every batch starts on a due step
    assert not model.fc._forward_hooks


class FrozenTwoClass(LightningModule):
    """Half the samples aligned, half opposed, nothing learns: scores exactly +-0.5 (bimodal)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(5 * torch.eye(2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.head(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit_frozen_two_class(tmp_path, rows: torch.Tensor, max_epochs: int):
    """``FrozenTwoClass`` on 20 copies of ``rows`` (all of class 0), with GWA and a TensorBoard logger."""
    x = rows.repeat(20, 1)
    loader = DataLoader(TensorDataset(x, torch.zeros(len(x), dtype=torch.long)), batch_size=10)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, logger, [gwa], max_epochs=max_epochs).fit(FrozenTwoClass(), loader)
    return gwa, logger


def test_bimodal_scores_alert_and_no_score(tmp_path) -> None:
    gwa, logger = _fit_frozen_two_class(tmp_path, torch.eye(2), max_epochs=2)
    assert all(r["score"] is None for r in gwa.history)
    scalars = tb_scalars(logger.log_dir)
    assert "gwa/score" not in scalars
    assert scalars["gwa/kurtosis"][0][1] == pytest.approx(-2.0, abs=1e-6)
    assert scalars["gwa/mean"][0][1] == pytest.approx(0.0, abs=1e-6)
    alerts = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))]
    assert [a["kind"] for a in alerts] == ["bimodal"]  # a condition: one alert while it lasts
    assert alerts[0]["value"] == pytest.approx(-2.0, abs=1e-6) and alerts[0]["threshold"] == -1.2
    assert alerts[0]["severity"] == "warning" and "noisy labels" in alerts[0]["message"]  # half the samples oppose
    assert ("bimodal", None) in gwa.active_conditions()


def test_bimodal_scores_with_no_sample_opposing_are_no_warning(tmp_path) -> None:
    """Two groups that both align with the weights (scores 0.5 and 0.67, none negative: a model that fits one group of
    samples more closely than the other) are bimodal too; said as info, not as noisy labels (a clean run that had fit
    its data drew a warning saying that 0.0% of the samples oppose the weights, usually noisy labels)."""
    gwa, logger = _fit_frozen_two_class(tmp_path, torch.tensor([[1.0, 0.0], [1.0, -0.5]]), max_epochs=1)
    assert gwa.history[0]["negative"] == 0 and gwa.history[0]["kurtosis"] == pytest.approx(-2.0, abs=1e-6)
    alerts = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))]
    assert [(a["kind"], a["severity"]) for a in alerts] == [("bimodal", "info")]
    assert "0.0% of the samples oppose" in alerts[0]["message"] and "not noisy labels" in alerts[0]["message"]



class FlippedPerEpoch(FrozenTwoClass):
    """FrozenTwoClass whose labels are wrong for a set share of the samples, a different share each epoch: every score
    is +0.5 (right label) or -0.5 (flipped), so the share decides the mean and the kurtosis exactly."""

    def __init__(self, shares: list[float], n: int = 40) -> None:
        super().__init__()
        self.shares, self.n = shares, n

    def labels(self, epoch: int) -> torch.Tensor:
        y = torch.arange(self.n) % 2
        k = round(self.shares[epoch] * self.n)
        y[:k] = 1 - y[:k]
        return y

    def train_dataloader(self):
        x = torch.eye(2).repeat(self.n // 2, 1)
        return DataLoader(TensorDataset(x, self.labels(self.current_epoch)), batch_size=10)


def test_bimodal_epochs_rank_above_every_score_and_checkpoint_keeps_the_pick(tmp_path) -> None:
    """Bimodal scores with a positive mean (GWA undefined: kurtosis + 1.2 <= 0) whose share of negative scores has
    settled (moved by at most 2 points since the epoch before) rank above every defined score, the most bimodal
    first; ``gwa/selection`` orders the epochs the same way, so ModelCheckpoint on it keeps the pick. Shares of flipped
    labels per epoch: 10% (warm-up), 15%, 30% (bimodal, but 15 points from the epoch before: not ranked), 5%, 40%
    (bimodal, 35 points from the epoch before: not ranked), 40% (bimodal and settled: the pick), 50% (mean 0: not
    ranked)."""
    shares = [0.10, 0.15, 0.30, 0.05, 0.40, 0.40, 0.50]
    model = FlippedPerEpoch(shares)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=1)
    best = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="gwa/selection", mode="max", filename="{epoch}")
    by_score = ModelCheckpoint(dirpath=str(tmp_path / "ckpt_score"), monitor="gwa/score", mode="max",
                               filename="{epoch}")
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, logger, [gwa, best, by_score], max_epochs=len(shares),
                 reload_dataloaders_every_n_epochs=1).fit(model)
    oracle = [np.where(model.labels(e).numpy() == np.arange(40) % 2, 0.5, -0.5) for e in range(len(shares))]
    kurt = [scipy.stats.kurtosis(o, bias=True) for o in oracle]
    bimodal = [k + 1.2 <= 0 for k in kurt]
    assert bimodal == [False, False, True, False, True, True, True]
    for rec, o, k in zip(gwa.history, oracle, kurt):
        assert rec["mean"] == pytest.approx(o.mean(), abs=1e-9) and rec["kurtosis"] == pytest.approx(k, rel=1e-6)
    assert [r["score"] is None for r in gwa.history] == bimodal
    # the pick: epoch 5, the one settled bimodal epoch with a positive mean (epoch 6 has mean 0)
    assert gwa.best_epoch == 5 and gwa.best_score is None
    assert [r["eligible"] for r in gwa.history] == [False, True, False, True, False, True, False]
    assert os.path.basename(best.best_model_path) == "epoch=5.ckpt"
    assert os.path.basename(by_score.best_model_path) == "epoch=1.ckpt"  # the paper's score alone: the best defined
    assert float(best.best_model_score) == pytest.approx(1.0 + (-1.2 - kurt[5]) / 0.8, rel=1e-6)
    scalars = tb_scalars(logger.log_dir)
    assert [s for s, _ in scalars["gwa/score"]] == [gwa.history[e]["step"] for e in (0, 1, 3)]  # defined ones only
    assert scalars["gwa/best_epoch"][-1][1] == 5.0
    assert "gwa/selection" not in scalars  # for ModelCheckpoint / EarlyStopping only, not a chart
    alerts = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))]
    raised = [a for a in alerts if a["kind"] == "bimodal"]
    # each says what the selection made of the epoch that raised it (epochs 2 and 4: shares still moving, not ranked;
    # epoch 5, the pick, continues the condition raised at 4)
    assert len(raised) == 2 and [a["step"] for a in raised] == [gwa.history[e]["step"] for e in (2, 4)]
    assert "not ranked in the selection: its share of opposed samples moved by 15.0 points" in raised[0]["message"]
    assert "moved by 35.0 points" in raised[1]["message"] and "ranks above" not in raised[1]["message"]
    text = summarize(load_run(logger.log_dir))  # the report on the same logs
    assert "GWA: best epoch 5 (gwa/best_epoch at step" in text
    assert "epochs of bimodal scores (no score logged) rank above every score" in text


def test_the_bimodal_alert_says_whether_its_epoch_ranks(tmp_path) -> None:
    """The alert says what the selection makes of the epoch that raised it: a settled share of opposed samples (29% ->
    30%, bimodal from 30% at scores of +-0.5) ranks above every score; in the warm-up it is outside the selection."""
    model = FlippedPerEpoch([0.30, 0.10, 0.29, 0.30], n=100)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=1)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, logger, [gwa], max_epochs=4, reload_dataloaders_every_n_epochs=1).fit(model)
    assert [r["score"] is None for r in gwa.history] == [True, False, False, True]
    raised = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))]
    raised = [a for a in raised if a["kind"] == "bimodal"]
    assert [a["step"] for a in raised] == [gwa.history[e]["step"] for e in (0, 3)]
    assert "In the warm-up, the epoch is not part of the selection." in raised[0]["message"]
    assert "ranks above every defined score in the selection" in raised[1]["message"]
    assert gwa.best_epoch == 3


def test_bimodal_ranks_in_the_selection_and_its_patience() -> None:
    """The selection rule alone: a bimodal epoch (kurtosis given) beats any defined score; among bimodal epochs a
    lower kurtosis wins; a defined score after a bimodal pick counts against patience; a checkpoint saved before the
    rule resumes with its best score."""
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, stop=True, patience=2)
    assert gwa._select(0, 5.0) and gwa.best_epoch == 0
    assert gwa._select(1, None, -1.3) and gwa.best_epoch == 1 and gwa.best_score is None and gwa.wait == 0
    assert gwa._select(2, 1e9) and gwa.best_epoch == 1 and gwa.wait == 1
    assert gwa._select(3, None, -1.5) and gwa.best_epoch == 3 and gwa.wait == 0
    assert gwa._select(4, None, -1.4) and gwa.best_epoch == 3 and gwa.wait == 1
    assert not gwa._select(5, None) and gwa.wait == 2
    assert "bimodal scores, excess kurtosis -1.500" in gwa._best_text()
    values = [gwa._selection_value(s, k) for s, k in ((-3.0, 0.0), (0.0, 0.0), (50.0, 0.0), (None, -1.2), (None, -2.0))]
    assert values == sorted(values) and values[0] > 0 and values[-1] == 2.0
    again = GradientWeightAlignmentMonitor(warmup_epochs=0)
    again.load_state_dict(gwa.state_dict())
    assert again.best_epoch == 3 and again._best_rank == (1, 1.5)
    legacy = {k: v for k, v in GradientWeightAlignmentMonitor(warmup_epochs=0).state_dict().items() if k != "best_rank"}
    legacy.update(best_epoch=2, best_score=0.3)
    old = GradientWeightAlignmentMonitor(warmup_epochs=0)
    old.load_state_dict(legacy)
    assert old._best_rank == (0, 0.3) and not old._select(3, None) and old._select(4, 0.31) and old.best_epoch == 4


# ---------------------------------------------------------------------- DDP
class RankDump(Callback):
    """Writes, per rank, the module's autograd oracle scores and the monitor's history."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        gwa = next(c for c in trainer.callbacks if isinstance(c, GradientWeightAlignmentMonitor))
        oracle = {e: torch.cat(v) for e, v in pl_module.oracle.items()}
        torch.save(
            {"oracle": oracle, "history": gwa.history, "stopped": gwa.stopped_epoch, "epoch": trainer.current_epoch},
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


def test_ddp_moments_and_stop_decision_are_reduced(tmp_path) -> None:
    torch.manual_seed(5)
    loader, _ = _loader(400, batch_size=50, shuffle=False)
    gwa = GradientWeightAlignmentMonitor(stop=True, patience=1, warmup_epochs=0, log_histograms=False)
    trainer = _trainer(
        tmp_path,
        False,
        [gwa, RankDump(str(tmp_path))],
        max_epochs=4,
        devices=2,
        strategy="ddp_spawn",
        enable_checkpointing=False,
    )
    fit_ddp_spawn(trainer, DigitsMLP(lr=0.5), loader)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["history"] == r1["history"] and r0["stopped"] == r1["stopped"] and r0["epoch"] == r1["epoch"]
    for rec in r0["history"]:
        both = torch.cat([r0["oracle"][rec["epoch"]], r1["oracle"][rec["epoch"]]]).numpy()
        assert rec["count"] == len(both) == 400
        assert rec["score"] == pytest.approx(_scipy_gwa(both), rel=1e-4, abs=1e-6)
        assert rec["negative"] == int((both < 0).sum())


def test_bf16_autocast_recomputes_wz_in_fp32(tmp_path) -> None:
    torch.manual_seed(6)
    model = DigitsMLP(record=False)
    loader, _ = _loader(200, batch_size=50)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    _trainer(tmp_path, False, [gwa], max_epochs=1, precision="bf16-mixed").fit(model, loader)
    rec = gwa.history[0]
    assert rec["count"] == 200 and math.isfinite(rec["score"]) and -1 <= rec["mean"] <= 1
    # the kept W z is float32 even though the head ran in bfloat16
    x = torch.randn(4, 64)
    gwa._reset_epoch(None)
    gwa._pending = (torch.zeros(4, dtype=torch.long), None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gwa.keep(model.fc.register_forward_hook(gwa._on_head_forward, with_kwargs=True))
        out = model(x)
    assert out.dtype == torch.bfloat16 and gwa._stash[0].wz.dtype == torch.float32
    gwa.release()
    assert not model.fc._forward_hooks


class ProjectorInStep(LightningModule):
    """The training step calls the encoder and the classifier itself, and a top-level projection registered last
    on the features (a regulariser): the classifier is nested deeper than the projection, and called before it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = AuxAfter()
        self.proj = nn.Linear(32, 16)

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        z = self.model.encoder(x)
        logits = self.model.decision(z)
        return F.cross_entropy(logits, y) + 1e-3 * self.proj(z).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_the_head_is_the_linear_whose_gradient_is_a_softmaxs(tmp_path) -> None:
    # the rule that preferred the output returned by the outermost call took the shallowest name: here `proj` (its own
    # call is top-level), scored silently (its 16 outputs fit the 10 classes' targets). A softmax cross-entropy's
    # gradient on its logits has rows that sum to 0; the regulariser's does not
    loader, _ = _loader(100, batch_size=50)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, every_n_steps=1)
    _trainer(tmp_path, False, [gwa], max_epochs=1).fit(ProjectorInStep(), loader)
    assert gwa._head_name == "model.decision" and gwa.history[0]["count"] == 100


class _PreNormLM(LightningModule):
    """Pre-LN blocks, a final LayerNorm and a head called by the training step: each block's `fc2` feeds a residual
    stream that ends in the LayerNorm, whose input gradient has rows that sum to 0, as a softmax's does."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(width), "fc1": nn.Linear(width, 2 * width),
                                                   "fc2": nn.Linear(2 * width, width)}) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def training_step(self, batch, batch_idx):
        h = self.emb(batch[0])
        for b in self.blocks:
            h = h + b["fc2"](F.gelu(b["fc1"](b["norm"](h))))
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_the_head_is_found_in_bf16_too(tmp_path, precision) -> None:
    # in bf16 the head's gradient rows sum to 0 only up to bf16's rounding (2e-3 of their size, over the 1e-3 allowed):
    # the last block's fc2, whose rows sum to 0 through the LayerNorm, was taken, and GWA went idle blaming the targets
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (32, 9), generator=g)
    loader = DataLoader(list(zip(ids[:, :-1], ids[:, 1:])), batch_size=8)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, every_n_steps=1)
    Trainer(max_steps=8, precision=precision, callbacks=[gwa], logger=False, enable_progress_bar=False,
            enable_checkpointing=False, enable_model_summary=False, accelerator="cpu").fit(_PreNormLM(), loader)
    assert gwa._head_name == "head" and gwa.idle_reason is None


@pytest.mark.parametrize("max_epochs, planned, warmup", [(1000, 20, 2), (-1, 20, 2), (10, 10, 1)])
def test_a_time_limited_run_plans_its_warm_up_from_the_first_epochs_pace(tmp_path, monkeypatch, max_epochs, planned,
                                                                        warmup) -> None:
    # max_time with a large max_epochs: a 10% warm-up of 1000 epochs is 100, and a run that time ends in 20 epochs
    # never logged a best epoch (a warning said so); with max_time alone GWA stayed idle ("an unbounded run"). The
    # warm-up is now 10% of the epochs the time allows at the first epoch's pace (a clock of 2 s an epoch, 40 s
    # allowed: 20 epochs), or of max_epochs where fewer
    from lightning.pytorch.callbacks import Timer

    # seeded: unseeded, the weights and the order came from whatever ran before in the process, and on some draws
    # epochs 1-2 were bimodal (no score), which is not what is under test
    torch.manual_seed(0)
    monkeypatch.setattr(Timer, "time_elapsed", lambda self, stage="train": 2.0)
    monkeypatch.setattr(Timer, "time_remaining", lambda self, stage="train": 38.0)
    loader, _ = _loader(100, batch_size=50)  # 2 steps an epoch
    gwa = GradientWeightAlignmentMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, False, [gwa, _StopAt(8)], max_epochs=max_epochs,
                 max_time={"seconds": 40}).fit(DigitsMLP(), loader)
    assert not [str(w.message) for w in caught if "GradientWeightAlignment" in str(w.message)]  # nothing to warn of
    assert gwa.idle_reason is None and gwa._warmup_resolved == warmup
    (said,) = [a for a in gwa.hub.history if a.kind == "warmup_planned"]
    assert said.step == 2 and f"opens at epoch {warmup}" in said.message and f"about {planned} epochs" in said.message
    assert ("that `max_time` allows" in said.message) == (planned == 20)
    assert [h["epoch"] for h in gwa.history if h["eligible"]] == list(range(warmup, 4))
    # kept in checkpoints: a resume does not plan again from a clock that has run on
    resumed = GradientWeightAlignmentMonitor()
    resumed.load_state_dict(gwa.state_dict())
    assert resumed._timed_warmup == warmup


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.should_stop = trainer.should_stop or trainer.global_step >= self.step


class _PartlyLabelled(LightningModule):
    """Semi-supervised: unlabelled samples carry -1, which the loss ignores (`ignore_index=-1`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.fc(batch[0]), batch[1], ignore_index=-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_targets_the_loss_ignores_after_the_first_batch_are_not_scored(tmp_path) -> None:
    # the targets were checked on the first batch only: a later -1 crashed the fit at the epoch's end (an index out of
    # bounds in the scatter; a device-side assert on a GPU)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x[:, :4].argmax(1)
    y[16::3] = -1  # the first batch is fully labelled
    loader = DataLoader(TensorDataset(x, y, torch.arange(64)), batch_size=16)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, index_fn=lambda b: b[2], suspects=64)
    _trainer(tmp_path, False, [gwa], max_epochs=2).fit(_PartlyLabelled(), loader)
    assert [h["count"] for h in gwa.history] == [48, 48]
    said = [a for a in gwa.hub.history if a.kind == "targets_out_of_range"]
    assert len(said) == 1 and said[0].value == 16.0 and "ignore_index" in said[0].message


class _SigmoidBinary(LightningModule):
    """A one-logit sigmoid head: the only nn.Linear with >= 2 outputs is a hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.out = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        return F.binary_cross_entropy_with_logits(self.out(self.body(batch[0])).squeeze(-1), batch[1].float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _TwoHeads(LightningModule):
    """The model returns its classifier's and an auxiliary classifier's logits, both trained with cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.fc, self.aux = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.body(x))), self.aux(x)

    def training_step(self, batch, batch_idx):
        main, aux = self(batch[0])
        return F.cross_entropy(main, batch[1]) + 0.3 * F.cross_entropy(aux, batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _four_classes(n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :4].argmax(1) % 2), batch_size=16), DataLoader(
        TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)


def test_a_hidden_layer_taken_for_the_head_is_said(tmp_path) -> None:
    # a one-logit sigmoid head with integer labels: the hidden Linear(8, 16) was scored as a 16-class head, silently
    # (with one candidate its gradient was never looked at)
    binary, _ = _four_classes()
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    _trainer(tmp_path, False, [gwa], max_epochs=1).fit(_SigmoidBinary(), binary)
    said = [a for a in gwa.hub.history if a.kind == "no_softmax_head"]
    assert len(said) == 1 and said[0].severity == "warning" and "`body.0` is scored" in said[0].message


def test_two_qualifying_heads_are_named(tmp_path) -> None:
    _, classes = _four_classes()
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    _trainer(tmp_path, False, [gwa], max_epochs=1).fit(_TwoHeads(), classes)
    said = [a for a in gwa.hub.history if a.kind == "several_heads"]
    assert len(said) == 1 and "`fc`, `aux`" in said[0].message and gwa._head_name == "aux"
    assert not [a for a in gwa.hub.history if a.kind == "no_softmax_head"]


class TwoHeads(LightningModule):
    """A main head and an auxiliary one on the same trunk, both softmax cross-entropies, the auxiliary called last;
    batches are ``(x, y_main, y_aux)``, so the default ``target_fn`` (``batch[1]``) reads the main head's targets."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        x, ya, yb = batch
        h = self.trunk(x)
        return F.cross_entropy(self.head_a(h), ya) + 0.3 * F.cross_entropy(self.head_b(h), yb)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_targets_of_another_qualified_head_switch_the_head(tmp_path) -> None:
    """Both heads qualify (softmax gradients, returned); the one called last is scored first, its gradient points at
    other classes than the targets read, so the other qualified head is scored instead (said once, info) and checked
    at the next due step. It went idle before, blaming `target_fn`."""
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    ya, yb = (x @ torch.randn(8, 4)).argmax(1), (x @ torch.randn(8, 4)).argmax(1)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, every_n_steps=1)
    gwa.idle_when_nothing_to_watch = True  # as the preset sets it: a mismatch would leave it idle
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, logger, [gwa], max_epochs=2).fit(TwoHeads(), DataLoader(TensorDataset(x, ya, yb), batch_size=16))
    assert gwa.idle_reason is None and gwa._head_name == "head_a"
    alerts = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))]
    kinds = [a["kind"] for a in alerts]
    assert "head_changed" in kinds and "nothing_to_watch" not in kinds
    assert "`head_a`" in alerts[kinds.index("head_changed")]["message"]
    assert gwa._targets_verified  # head_a's gradient points at the targets read
    # the two steps scored for head_b (the one choosing the head, the one checking it) are dropped; then every sample
    assert [r["count"] for r in gwa.history] == [256 - 32, 256]
    assert len(tb_scalars(logger.log_dir)["gwa/mean"]) == 2


class BufferHead(LightningModule):
    """A classifier whose last nn.Linear keeps its weight and bias as buffers (a frozen mixing of the logits, out of
    the optimizer): the head module has no parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.fixed = nn.Linear(4, 4)
        w, b = self.fixed.weight.detach().clone(), self.fixed.bias.detach().clone()
        del self.fixed.weight, self.fixed.bias
        self.fixed.register_buffer("weight", w)
        self.fixed.register_buffer("bias", b)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.fixed(self.body(batch[0])), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_a_head_without_parameters_does_not_end_the_epochs(tmp_path) -> None:
    """The head's device was read as ``next(head.parameters())``: its StopIteration, raised inside a hook, was taken
    by Lightning's loop for the end of the data, so no optimizer step ever completed and every epoch ended after one
    batch (a fit with ``max_steps`` only never ended)."""
    from lightning_monitor import HealthMonitor

    torch.manual_seed(0)
    x = torch.randn(128, 8)
    y = (x @ torch.randn(8, 4)).argmax(1)
    monitor = HealthMonitor(spectral=False, noise_scale=False, guard=False)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = _trainer(tmp_path, logger, [monitor], max_epochs=3, max_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(BufferHead(), DataLoader(TensorDataset(x, y), batch_size=16))
    assert trainer.global_step == 20
    assert monitor.gwa._head_name == "fixed" and monitor.gwa.idle_reason is None
    assert monitor.gwa.history and monitor.gwa.history[0]["count"] > 0


def test_an_auxiliary_head_of_fewer_classes_than_the_targets_is_not_taken(tmp_path) -> None:
    """The auxiliary head (3 classes, called last) cannot hold the main targets (4 classes): the main head is taken
    at once. Before, the auxiliary one was chosen and its target check failed the fit."""

    class Aux3(TwoHeads):
        def __init__(self) -> None:
            super().__init__()
            self.head_b = nn.Linear(16, 3)

    torch.manual_seed(0)
    x = torch.randn(128, 8)
    ya, yb = (x @ torch.randn(8, 4)).argmax(1), (x @ torch.randn(8, 3)).argmax(1)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, False, [gwa], max_epochs=1).fit(Aux3(), DataLoader(TensorDataset(x, ya, yb), batch_size=16))
    assert gwa._head_name == "head_a" and gwa.idle_reason is None and gwa.history[0]["count"] > 0


class FrozenHead(DigitsMLP):
    """The body trains while the head's weight is kept frozen (as in a LoRA fine-tune whose `lm_head` is not adapted)."""

    def __init__(self) -> None:
        super().__init__(record=True)
        self.fc.requires_grad_(False)


def test_a_frozen_head_is_scored_and_said(tmp_path) -> None:
    loader, _ = _loader(200, batch_size=50, shuffle=False)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    torch.manual_seed(0)
    model = FrozenHead()
    before = model.fc.weight.detach().clone()
    _trainer(tmp_path, logger, [gwa], max_epochs=2).fit(model, loader)
    assert torch.equal(model.fc.weight, before)  # the head never moved
    alerts = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))]
    frozen = [a for a in alerts if a["kind"] == "frozen_head"]
    assert len(frozen) == 1 and frozen[0]["severity"] == "info" and "`fc` is frozen" in frozen[0]["message"]
    # still scored, and exactly: the per-sample gradients are the head's whether or not its weight trains
    for epoch, record in enumerate(gwa.history):
        oracle = torch.cat(model.oracle[epoch]).numpy()
        assert record["count"] == 200 and record["score"] == pytest.approx(_scipy_gwa(oracle), rel=1e-4)
    # named with `head=` (no step watched): said as the fit starts
    named = GradientWeightAlignmentMonitor(head="fc", warmup_epochs=0)
    logger3 = TensorBoardLogger(str(tmp_path), name="tb3")
    _trainer(tmp_path, logger3, [named], max_epochs=1).fit(FrozenHead(), loader)
    kinds = [json.loads(line)["kind"] for line in open(os.path.join(logger3.log_dir, "alerts.jsonl"))]
    assert kinds.count("frozen_head") == 1
    # a trained head is not said to be frozen
    ok = GradientWeightAlignmentMonitor(warmup_epochs=0)
    logger2 = TensorBoardLogger(str(tmp_path), name="tb2")
    _trainer(tmp_path, logger2, [ok], max_epochs=1).fit(DigitsMLP(record=False), loader)
    path = os.path.join(logger2.log_dir, "alerts.jsonl")
    kinds = [json.loads(line)["kind"] for line in open(path)] if os.path.exists(path) else []
    assert "frozen_head" not in kinds


class _FreezeHeadAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            pl_module.fc.requires_grad_(False)


def test_a_head_frozen_mid_run_is_said_once(tmp_path) -> None:
    loader, _ = _loader(200, batch_size=50, shuffle=False)  # 4 steps an epoch
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    _trainer(tmp_path, logger, [_FreezeHeadAt(6), gwa], max_epochs=3).fit(DigitsMLP(record=False), loader)
    frozen = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))
              if json.loads(line)["kind"] == "frozen_head"]
    assert len(frozen) == 1 and frozen[0]["step"] == 8  # the end of the epoch in which it was frozen
    assert "was frozen during the run" in frozen[0]["message"]
    assert len(gwa.history) == 3 and all(r["count"] == 200 for r in gwa.history)  # still scored


class _SmoothedThreeClass(LightningModule):
    """Three classes (two cannot show a smoothing: every softmax gradient row is then along (1, -1)), nothing learns,
    label smoothing 0.1: half the samples aligned with their label, half opposed."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(3 * torch.eye(3))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.head(batch[0]), batch[1], label_smoothing=0.1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_bimodal_scores_in_the_warm_up_or_under_label_smoothing_are_no_warning(tmp_path) -> None:
    # half the samples oppose the weights: in the window a warning ("usually noisy labels"); in the warm-up a model
    # still learning resists what it has not fit yet, and with label smoothing every confident fit opposes its label
    x = torch.eye(2).repeat(20, 1)
    loader = DataLoader(TensorDataset(x, torch.zeros(len(x), dtype=torch.long)), batch_size=10)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=1)
    logger = TensorBoardLogger(str(tmp_path), name="warm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, logger, [gwa], max_epochs=2).fit(FrozenTwoClass(), loader)
    said = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))]
    assert [(a["kind"], a["severity"]) for a in said if a["kind"] == "bimodal"] == [("bimodal", "info"),
                                                                                    ("bimodal", "warning")]
    assert "in the warm-up" in said[0]["message"]
    # in the window, half the samples opposed: the warning names a model near chance beside noisy labels
    assert "usually noisy labels" in said[1]["message"] and "has not fit its data yet" in said[1]["message"]
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    logger = TensorBoardLogger(str(tmp_path), name="smoothed")
    x3 = torch.eye(3)[:2].repeat(20, 1)
    loader3 = DataLoader(TensorDataset(x3, torch.zeros(len(x3), dtype=torch.long)), batch_size=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, logger, [gwa], max_epochs=2).fit(_SmoothedThreeClass(), loader3)
    said = [json.loads(line) for line in open(os.path.join(logger.log_dir, "alerts.jsonl"))]
    bimodal = [a for a in said if a["kind"] == "bimodal"]
    assert gwa._label_smoothing == pytest.approx(0.1, rel=1e-3)
    assert bimodal and all(a["severity"] == "info" for a in bimodal) and "smooths its labels" in bimodal[0]["message"]
