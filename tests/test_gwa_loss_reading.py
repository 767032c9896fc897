"""GWA reads the loss off the head's gradient: a loss that shifts the labels itself, a loss on scaled or biased logits
(Cohere's ``logit_scale``, Granite's ``logits_scaling``, BART's ``final_logits_bias``), label smoothing (which, near a
uniform softmax, looks like a logit scale of 1 / (1 - eps)), and one that is no such cross-entropy (a z-loss). Against scores computed here from the head output's real gradient: the cosine of
``-g_i z_i^T`` with ``W`` is the paper's gamma of the loss the model trains on, whatever that loss does to the logits."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_monitor import GradientWeightAlignmentMonitor, read_alerts
from lightning_monitor.functional.gwa import gwa_scores, head_gradient_agreement, head_gradient_fit, label_smoothing_fit

V, T, D = 11, 6, 16


# ------------------------------------------------------------------ the functions
def _per_row_gradient(logits: torch.Tensor, loss_fn) -> torch.Tensor:
    o = logits.clone().requires_grad_()
    loss_fn(o).backward()
    return o.grad


@pytest.mark.parametrize("scale, with_bias", [(1.0, False), (0.0625, False), (1 / 8, False), (1.0, True), (3.0, True)])
def test_the_fit_reads_the_scale_and_bias_the_loss_applied(scale: float, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    o = torch.randn(40, V, generator=g) * 3
    b = torch.randn(V, generator=g) * 2 if with_bias else torch.zeros(V)
    y = torch.randint(0, V, (40,), generator=g)
    grad = _per_row_gradient(o, lambda o: F.cross_entropy(scale * o + b, y))
    fit = head_gradient_fit(grad, o)
    assert fit.rows == 40 and fit.scale == pytest.approx(scale, rel=1e-5) and fit.residual < 1e-4
    if with_bias:
        assert fit.bias is not None and torch.allclose(fit.bias, (b - b.mean()).double(), atol=1e-4)
    else:
        assert fit.bias is None
    # scored through what was measured, the closed form agrees with the gradient on every row
    judged, off, targeted, hit = head_gradient_agreement(grad, o, y, logit_scale=fit.scale, logit_bias=fit.bias).tolist()
    assert judged > 30 and off == 0 and targeted == hit == 40


def test_label_smoothing_is_no_such_transform() -> None:
    g = torch.Generator().manual_seed(1)
    o, y = torch.randn(64, V, generator=g) * 3, torch.randint(0, V, (64,), generator=g)
    grad = _per_row_gradient(o, lambda o: F.cross_entropy(o, y, label_smoothing=0.2))
    assert head_gradient_fit(grad, o).residual > 0.05
    judged, off, _, _ = head_gradient_agreement(grad, o, y).tolist()
    assert off > 0.1 * judged
    # the loss's soft targets make the closed form exact
    soft = F.one_hot(y, V).double() * 0.8 + 0.2 / V
    judged, off, _, _ = head_gradient_agreement(grad, o, soft).tolist()
    assert judged == 64 and off == 0


@pytest.mark.parametrize("eps", [0.05, 0.1, 0.3])
@pytest.mark.parametrize("spread", [0.05, 1.0, 5.0])
def test_the_smoothing_fit_reads_the_loss_s_smoothing(eps: float, spread: float) -> None:
    g = torch.Generator().manual_seed(3)
    o, y = torch.randn(48, V, generator=g) * spread, torch.randint(0, V, (48,), generator=g)
    grad = _per_row_gradient(o, lambda o: F.cross_entropy(o, y, label_smoothing=eps))
    rows, read = label_smoothing_fit(grad, o, y)
    assert rows == 48 and read == pytest.approx(eps, abs=1e-5)
    smooth = head_gradient_agreement(grad, o, y, label_smoothing=read, misfit=True).tolist()
    assert smooth[1] == 0 and smooth[4] / smooth[0] < 1e-9
    fit = head_gradient_fit(grad, o)
    scaled = head_gradient_agreement(grad, o, y, logit_scale=fit.scale, logit_bias=fit.bias, misfit=True).tolist()
    assert scaled[4] > 100 * smooth[4]  # the smoothing reads the gradient closer than any scale and bias
    if spread == 0.05:  # near a uniform softmax smoothing passes for an exact logit scale of 1 / (1 - eps)
        assert fit.scale == pytest.approx(1 / (1 - eps), rel=0.02) and fit.residual < 2e-3
    # no smoothing reads as none
    plain = _per_row_gradient(o, lambda o: F.cross_entropy(o, y))
    assert abs(label_smoothing_fit(plain, o, y)[1]) < 1e-6


def test_two_classes_show_no_smoothing() -> None:
    """With two classes every gradient row is +-(1, -1) whatever the smoothing: it cannot be read, and is not."""
    g = torch.Generator().manual_seed(5)
    o, y = torch.randn(32, 2, generator=g), torch.randint(0, 2, (32,), generator=g)
    for eps in (0.0, 0.2):
        grad = _per_row_gradient(o, lambda o: F.cross_entropy(o, y, label_smoothing=eps))
        rows, read = label_smoothing_fit(grad, o, y)
        assert rows == 32 and read != read  # NaN


def test_gwa_scores_with_label_smoothing_against_autograd() -> None:
    g = torch.Generator().manual_seed(4)
    z, w = torch.randn(12, D, generator=g), torch.randn(V, D, generator=g)
    y = torch.randint(0, V, (12,), generator=g)
    y[3] = -100  # ignored: no score
    ours = gwa_scores(z, z @ w.T, y, w, label_smoothing=0.2)
    assert torch.isnan(ours[3])
    for i in [i for i in range(12) if i != 3]:
        wi = w.clone().requires_grad_()
        F.cross_entropy(z[i:i + 1] @ wi.T, y[i:i + 1], label_smoothing=0.2).backward()
        ref = F.cosine_similarity(-wi.grad.flatten(), w.flatten(), dim=0)
        assert float(ours[i]) == pytest.approx(float(ref), abs=1e-5)
    with pytest.raises(ValueError, match="label_smoothing"):
        gwa_scores(z, z @ w.T, y, w, label_smoothing=1.0)


def test_gwa_scores_through_a_transform_against_autograd() -> None:
    g = torch.Generator().manual_seed(2)
    z, w = torch.randn(12, D, generator=g), torch.randn(V, D, generator=g)
    y, b = torch.randint(0, V, (12,), generator=g), torch.randn(V, generator=g)
    ours = gwa_scores(z, z @ w.T, y, w, logit_scale=0.25, logit_bias=b)
    for i in range(12):  # each sample's own gradient of W, by autograd
        wi = w.clone().requires_grad_()
        F.cross_entropy(0.25 * (z[i:i + 1] @ wi.T) + b, y[i:i + 1]).backward()
        ref = F.cosine_similarity(-wi.grad.flatten(), w.flatten(), dim=0)
        assert float(ours[i]) == pytest.approx(float(ref), abs=1e-5)
    with pytest.raises(ValueError, match="logit_scale"):
        gwa_scores(z, z @ w.T, y, w, logit_scale=-1.0)
    with pytest.raises(ValueError, match="logit_bias"):
        gwa_scores(z, z @ w.T, y, w, logit_bias=torch.zeros(3))


# ------------------------------------------------------------------ the monitor, in a fit
class Tokens(Dataset):
    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, V, (n, T), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class TinyLM(pl.LightningModule):
    """A token model whose own loss reads its head's outputs its own way (``kind``); lr 0: the weights stay."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.emb = torch.nn.Embedding(V, D)
        self.body = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh())
        self.head = torch.nn.Linear(D, V)
        with torch.no_grad():
            # logits of a trained model's size, where the transform matters; "smoothed_init": a head at a small init,
            # its softmax nearly uniform (where smoothing passes for a logit scale)
            self.head.weight.mul_(0.05 if kind == "smoothed_init" else 8.0)
        self.register_buffer("final_bias", torch.randn(V) * 2)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat = lambda t: t.reshape(-1, V)  # noqa: E731
        if self.kind == "shifts":  # a decoder whose loss shifts the labels itself (BLIP's text decoder)
            return F.cross_entropy(flat(logits[:, :-1]), labels[:, 1:].reshape(-1))
        if self.kind == "shifts_smoothed":  # and smooths them (BLIP's text decoder at its default, 0.1)
            return F.cross_entropy(flat(logits[:, :-1]), labels[:, 1:].reshape(-1), label_smoothing=0.2)
        if self.kind == "scaled":  # Cohere's logit_scale
            return F.cross_entropy(flat(logits * 0.0625), labels.reshape(-1))
        if self.kind == "biased":  # BART's final_logits_bias, and a temperature
            return F.cross_entropy(flat(logits / 2.0 + self.final_bias), labels.reshape(-1))
        if self.kind == "smoothed":
            return F.cross_entropy(flat(logits), labels.reshape(-1), label_smoothing=0.3)
        if self.kind == "smoothed_init":
            return F.cross_entropy(flat(logits), labels.reshape(-1), label_smoothing=0.1)
        if self.kind == "zloss":  # PaLM's auxiliary z-loss: no smoothing, no transform explains it exactly
            return (F.cross_entropy(flat(logits), labels.reshape(-1))
                    + 1e-2 * (torch.logsumexp(flat(logits), -1) ** 2).mean())
        return F.cross_entropy(flat(logits), labels.reshape(-1))

    def training_step(self, batch, batch_idx):
        return self.loss(self.head(self.body(self.emb(batch["input_ids"]))), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def exact_scores(head: torch.nn.Linear, backward) -> torch.Tensor:
    """gamma of every row the loss trains on, from the head output's real gradient in ``backward()``: cos(-g_i z_i^T, W)
    (0 for a row of zero features, as GWA scores it)."""
    seen = {}

    def hook(m, args, out):
        seen.update(z=args[0].detach(), wz=(out if m.bias is None else out - m.bias).detach())
        out.register_hook(lambda g: seen.update(g=g.detach()))

    h = head.register_forward_hook(hook)
    backward()
    h.remove()
    g, z, wz = seen["g"].double(), seen["z"].double(), seen["wz"].double()
    keep = g.abs().sum(-1) > 0
    g, z, wz = g[keep], z[keep], wz[keep]
    ref = -(g * wz).sum(-1) / (g.norm(dim=-1) * z.norm(dim=-1) * head.weight.detach().double().norm())
    return torch.nan_to_num(ref, nan=0.0)


def fit(tmp_path, module: pl.LightningModule):
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=logger, callbacks=[gwa], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, DataLoader(Tokens(), batch_size=8))
    path = os.path.join(logger.log_dir, "alerts.jsonl")
    return gwa, (read_alerts(path) if os.path.exists(path) else [])


@pytest.mark.parametrize("kind, said", [("plain", set()), ("shifts", {"targets_shifted"}),
                                        ("scaled", {"logit_transform"}), ("biased", {"logit_transform"}),
                                        ("smoothed", {"label_smoothing"}), ("smoothed_init", {"label_smoothing"}),
                                        ("shifts_smoothed", {"targets_shifted", "label_smoothing"})])
def test_the_scores_are_the_loss_s_own(tmp_path, kind: str, said: set) -> None:
    module, ids = TinyLM(kind), Tokens().ids
    gwa, alerts = fit(tmp_path, module)
    ref = exact_scores(module.head, lambda: module.training_step({"input_ids": ids, "labels": ids}, 0).backward())
    # the first epoch loses the batches read before the check when the targets were read the other way; a transform
    # alone is applied to them when they are scored (they were dropped, and the epoch scored fewer rows or none)
    for rec in gwa.history[1:] if kind.startswith("shifts") else gwa.history[:2]:
        assert rec["count"] == ref.numel()
        assert rec["mean"] == pytest.approx(float(ref.mean()), rel=1e-4, abs=1e-7)
        assert rec["negative"] == float((ref < 0).sum())
    if kind.startswith("shifts"):
        assert gwa.history[0]["count"] < ref.numel()
    kinds = {a.kind for a in alerts}
    assert kinds & {"targets_shifted", "logit_transform", "label_smoothing", "inexact_scores", "target_mismatch"} == said
    assert gwa._shift is kind.startswith("shifts")
    assert (gwa._logit_scale is not None) is (kind in ("scaled", "biased"))
    assert (gwa._logit_bias is not None) is (kind == "biased")
    assert gwa._targets_verified
    if kind == "scaled":
        assert gwa._logit_scale == pytest.approx(0.0625, rel=1e-4)
    expected = {"smoothed": 0.3, "smoothed_init": 0.1, "shifts_smoothed": 0.2}.get(kind)
    assert (gwa._label_smoothing is None) if expected is None else gwa._label_smoothing == pytest.approx(expected, abs=1e-5)


def test_a_loss_the_closed_form_does_not_explain_is_scored_from_its_gradient(tmp_path) -> None:
    # a z-loss: no reading of the closed form explains it. The scores were approximate (an `inexact_scores` warning);
    # each row is now scored from its own output gradient, exactly
    module, ids = TinyLM("zloss"), Tokens().ids
    gwa, alerts = fit(tmp_path, module)
    switched = [a for a in alerts if a.kind == "scores_from_gradient"]
    assert len(switched) == 1 and switched[0].severity == "info" and switched[0].value > 0.1
    assert "inexact_scores" not in {a.kind for a in alerts}
    ref = exact_scores(module.head, lambda: module.training_step({"input_ids": ids, "labels": ids}, 0).backward())
    for rec in gwa.history[:2]:
        assert rec["count"] == ref.numel()
        assert rec["mean"] == pytest.approx(float(ref.mean()), rel=1e-4, abs=1e-7)
        assert rec["negative"] == float((ref < 0).sum())
    assert gwa._logit_scale is None and gwa._logit_bias is None and not gwa._shift
    # some smoothing reads a z-loss's gradient better than none, but not exactly: none is taken
    assert gwa._label_smoothing is None and "label_smoothing" not in {a.kind for a in alerts}


def test_shift_targets_given_is_kept(tmp_path) -> None:
    module, data = TinyLM("shifts"), Tokens()
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False, shift_targets=False)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, callbacks=[gwa], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, DataLoader(data, batch_size=8))
    assert not gwa._shift and not gwa._targets_verified


transformers = pytest.importorskip("transformers")


def _cohere():
    return transformers.CohereForCausalLM(transformers.CohereConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=T, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _blip_text(label_smoothing: float = 0.0):
    from transformers.models.blip.modeling_blip_text import BlipTextLMHeadModel
    return BlipTextLMHeadModel(transformers.BlipTextConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=T, encoder_hidden_size=16, pad_token_id=0, bos_token_id=1, sep_token_id=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, label_smoothing=label_smoothing))


def _blip_text_smoothed():
    return _blip_text(label_smoothing=0.1)


class HFLM(pl.LightningModule):
    def __init__(self, make) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = make()
        with torch.no_grad():
            self.model.get_output_embeddings().weight.mul_(8.0)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("make, kind", [(_cohere, "logit_transform"), (_blip_text, "targets_shifted"),
                                        (_blip_text_smoothed, "label_smoothing")],
                         ids=["Cohere (logit_scale)", "BLIP text decoder (own shift)", "BLIP, own shift, smoothed"])
def test_hugging_face_models_that_read_their_logits_their_own_way(tmp_path, make, kind) -> None:
    module, ids = HFLM(make), Tokens().ids
    gwa, alerts = fit(tmp_path, module)
    ref = exact_scores(module.model.get_output_embeddings(),
                       lambda: module.model(input_ids=ids, labels=ids).loss.backward())
    rec = gwa.history[1]
    assert rec["count"] == ref.numel()
    assert rec["mean"] == pytest.approx(float(ref.mean()), rel=1e-4, abs=1e-7)
    assert kind in {a.kind for a in alerts}


class _Tagged(torch.utils.data.Dataset):
    """``(input_ids, attention_mask, tags)`` tuples: the default ``target_fn`` takes ``batch[1]``, the mask."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, V, (64, T), generator=g)
        self.mask = torch.ones(64, T, dtype=torch.long)
        self.tags = (self.ids * 3 + 1) % V

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return self.ids[i], self.mask[i], self.tags[i]


class _Tagger(TinyLM):
    def training_step(self, batch, batch_idx):
        ids, mask, tags = batch
        return F.cross_entropy(self.head(self.body(self.emb(ids))).reshape(-1, V), tags.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("given", [False, True])
def test_targets_the_loss_does_not_train_leave_gwa_idle(tmp_path, given: bool) -> None:
    """The default ``target_fn`` reads the attention mask of an ``(ids, mask, tags)`` batch: the head's gradient points
    at other classes in most rows, so GWA publishes nothing (one ``nothing_to_watch`` warning) instead of scores of
    targets the run does not train; with ``target_fn`` naming the tags it scores them."""
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False,
                                         **({"target_fn": lambda b: b[2]} if given else {}))
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=logger, callbacks=[gwa], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(_Tagger("plain"), DataLoader(_Tagged(), batch_size=8))
    path = os.path.join(logger.log_dir, "alerts.jsonl")
    alerts = read_alerts(path) if os.path.exists(path) else []
    idle = [a for a in alerts if a.kind == "nothing_to_watch"]
    if given:
        assert not idle and gwa.idle_reason is None and gwa._targets_verified
        assert sum(h.get("count", 0) for h in gwa.history) > 0
    else:
        assert len(idle) == 1 and "another class than the targets GWA reads" in idle[0].message
        assert gwa.idle_reason is not None and gwa.history == [] and gwa.best_epoch is None
        assert not any(k.startswith("gwa/") for k in trainer.callback_metrics)


def test_an_epoch_emptied_by_the_check_says_why(tmp_path) -> None:
    # two batches an epoch: both are kept until the check at the second step finds the labels shifted, and dropped;
    # the epoch's warning blamed the cadence and the data
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, callbacks=[gwa], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match=r"epoch 0 scored 0 < \d+ samples.*dropped: their labels were read the other"):
        trainer.fit(TinyLM("shifts"), DataLoader(Tokens(16), batch_size=8))
    assert gwa._shift and gwa.history[1]["count"] > 0


class _SmoothingDump(pl.Callback):
    """Per rank: what the monitor read off the gradient, and its epoch records."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        gwa = next(c for c in trainer.callbacks if isinstance(c, GradientWeightAlignmentMonitor))
        torch.save({"smoothing": gwa._label_smoothing, "scale": gwa._logit_scale, "history": gwa.history},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


@pytest.mark.slow
def test_two_ranks_read_the_same_smoothing(tmp_path) -> None:
    """The readings are compared on both ranks' rows (reduced): the ranks adopt the same smoothing and score alike."""
    from conftest import fit_ddp_spawn

    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=2, logger=False,
                         callbacks=[gwa, _SmoothingDump(str(tmp_path))], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    fit_ddp_spawn(trainer, TinyLM("smoothed_init"), DataLoader(Tokens(64), batch_size=8))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["smoothing"] == ranks[1]["smoothing"] == pytest.approx(0.1, abs=1e-5)
    assert ranks[0]["scale"] is None and ranks[1]["scale"] is None
    assert ranks[0]["history"] == ranks[1]["history"] and ranks[0]["history"][0]["count"] == 64 * T


def test_plain_cross_entropy_in_bf16_is_not_read_as_a_scale(tmp_path) -> None:
    """A tiny BERT sequence classifier (3 classes, logits 0.02 apart at init) under `bf16-mixed`: the slope fitted to
    its bf16 gradient came out 0.93-1.11 on plain cross-entropy, adopted as a logit scale (`logit_transform`) and used
    all run. The slope's own error (the gradient's rounding over the logits' spread) now bounds what counts as a scale."""
    import lightning_monitor as lm

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, num_labels=3))
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(160):
        s = int(torch.randint(3, 64, (1,), generator=g))
        data.append({"input_ids": (torch.arange(16) + s) % 61 + 3, "attention_mask": torch.ones(16, dtype=torch.long),
                     "labels": torch.tensor(s % 3)})

    class Clf(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    gwa = lm.GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=12, precision="bf16-mixed", logger=False, callbacks=[gwa],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(Clf(), DataLoader(data, batch_size=8))
    assert gwa._check_step_done is not None
    assert gwa._logit_scale is None and gwa._logit_bias is None
    assert not {"logit_transform", "scores_from_gradient"} & {a.kind for a in gwa.hub.history}
