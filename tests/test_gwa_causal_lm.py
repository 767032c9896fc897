"""GWA on a Hugging Face causal LM: the labels are shifted as the model's loss shifts them, -100 tokens
are not samples, and unshifted targets raise a warning; against scores computed here from the head's
inputs (closed form of the paper's gamma)."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_monitor import GradientWeightAlignmentMonitor, read_alerts

transformers = pytest.importorskip("transformers")

VOCAB, T = 23, 8


class Tokens(Dataset):
    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (n, T), generator=g)
        self.labels = self.ids.clone()
        self.labels[::3, :2] = -100  # padding-like positions that are not samples

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class CausalLM(pl.LightningModule):
    def __init__(self, make=_gpt2) -> None:
        super().__init__()
        self.model = make()

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # fixed weights: the scores can be recomputed


def reference_scores(module: CausalLM, data: Tokens, shift: bool) -> torch.Tensor:
    """gamma_i = (y_i - p_i)^T W z_i / (||z_i|| ||y_i - p_i|| ||W||_F) per scored token."""
    seen = {}
    head = module.model.get_output_embeddings()
    h = head.register_forward_hook(lambda m, a, o: seen.update(z=a[0].detach(), logits=o.detach()))
    with torch.no_grad():
        module.model(input_ids=data.ids)
    h.remove()
    z, logits = seen["z"], seen["logits"]
    labels = torch.cat([data.labels[:, 1:], torch.full((len(data), 1), -100)], 1) if shift else data.labels
    keep = labels != -100
    z, logits, labels = z[keep], logits[keep], labels[keep]
    r = torch.nn.functional.one_hot(labels, VOCAB).double() - logits.double().softmax(-1)
    w = head.weight.detach().double()
    return (r * (z.double() @ w.T)).sum(-1) / (z.double().norm(dim=-1) * r.norm(dim=-1) * w.norm())


def run(tmp_path, gwa, make=_gpt2, epochs: int = 1):
    torch.manual_seed(0)
    module = CausalLM(make)
    data = Tokens()
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=logger, callbacks=[gwa],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         log_every_n_steps=1)
    trainer.fit(module, DataLoader(data, batch_size=8))
    path = os.path.join(logger.log_dir, "alerts.jsonl")
    return module, data, (read_alerts(path) if os.path.exists(path) else [])


def test_labels_shifted_and_ignored_tokens_dropped(tmp_path) -> None:
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    module, data, alerts = run(tmp_path, gwa)
    assert gwa._shift
    ref = reference_scores(module, data, shift=True)
    rec = gwa.history[0]
    assert rec["count"] == ref.numel() == 16 * T - 16 - 6  # each last position, and label[1] = -100 of 6 rows
    assert rec["mean"] == pytest.approx(float(ref.mean()), rel=1e-4)
    assert rec["negative"] == float((ref < 0).sum())
    assert not [a for a in alerts if a.kind == "target_mismatch"]


def _bert_decoder() -> torch.nn.Module:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=T, is_decoder=True,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertLMHeadModel(cfg)


def _xlnet() -> torch.nn.Module:
    cfg = transformers.XLNetConfig(vocab_size=VOCAB, d_model=16, n_layer=1, n_head=2, d_inner=32, dropout=0.0)
    return transformers.XLNetLMHeadModel(cfg)


@pytest.mark.parametrize("make, shift", [(_bert_decoder, True), (_xlnet, False)], ids=["BertLMHeadModel", "XLNet"])
def test_the_shift_follows_the_loss_the_model_computes(tmp_path, make, shift) -> None:
    # BertLMHeadModel (and Reformer's, OpenAI GPT's ...) compute the causal-LM loss, which shifts the labels, from a
    # class whose name does not say so: they were scored against unshifted targets, silently. XLNet's LM head is
    # trained on its labels as given (its own loss): not shifted
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    module, data, alerts = run(tmp_path, gwa, make, epochs=2)
    with torch.no_grad():
        given = module.model(input_ids=data.ids, labels=data.labels).loss
        logits = module.model(input_ids=data.ids).logits
    shifted = torch.cat([data.labels[:, 1:], torch.full((len(data), 1), -100)], 1)
    trained_on = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), (shifted if shift else data.labels).reshape(-1))
    assert float(given) == pytest.approx(float(trained_on), rel=1e-5)  # what the model's own loss scores
    assert gwa._shift is shift
    ref = reference_scores(module, data, shift=shift)
    measured = [a for a in alerts if a.kind == "targets_shifted"]
    # where the forward computes the shifted loss itself (BertLMHeadModel in transformers without
    # `PreTrainedModel.loss_function`, 4.40) the class does not say it: the shift is read from the head's gradient at
    # the first check (step 1: step 0 chooses the head), and the batches read before it, the other way, are dropped
    # (here the whole first epoch, of two batches); the epochs from the next on are scored whole
    in_class = shift is False or hasattr(transformers.PreTrainedModel, "loss_function")
    assert [a.step for a in measured] == ([] if in_class else [1])
    assert len(gwa.history) == 2 and gwa.history[0]["count"] == (0 if measured else ref.numel())
    for rec in gwa.history[0 if not measured else 1:]:  # lr 0: every epoch scores the same tokens the same way
        assert rec["count"] == ref.numel()
        assert rec["mean"] == pytest.approx(float(ref.mean()), rel=1e-4)
        assert rec["negative"] == float((ref < 0).sum())


def test_unshifted_targets_the_loss_does_not_train_leave_gwa_idle(tmp_path) -> None:
    """``shift_targets=False`` on a causal LM whose loss shifts the labels: the head's gradient points at the next
    token, not at the labels as given, so GWA says it and stays idle rather than score targets the run does not
    train."""
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False, shift_targets=False)
    run(tmp_path, gwa)
    assert not gwa._shift and gwa.history == []
    assert gwa.idle_reason is not None and "another class than the targets GWA reads" in gwa.idle_reason


class Fixed(pl.LightningModule):
    """A classifier with frozen weights (lr = 0) and a bias-free head: its logits are W z."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 5, bias=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.body(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _TrainsOn(Fixed):
    """``Fixed`` whose loss trains on targets of its own (``loss_targets``), whatever the batch's second item says."""

    def __init__(self, loss_targets: torch.Tensor) -> None:
        super().__init__()
        self.loss_targets = loss_targets

    def training_step(self, batch, batch_idx):
        x, _ = batch
        y = self.loss_targets[batch_idx * 16:(batch_idx + 1) * 16]
        return torch.nn.functional.cross_entropy(self.head(self.body(x)), y)


@pytest.mark.parametrize("pick, loss_pick, kind", [
    ("argmin", "argmin", "opposed_start"),  # the targets are the loss's: the head starts against them
    ("argmin", "argmax", "nothing_to_watch"),  # GWA reads other targets than the loss trains on: idle
    ("argmax", "argmax", None),
])
def test_nearly_all_negative_scores_warn_once(tmp_path, pick: str, loss_pick: str, kind) -> None:
    """Targets chosen as each sample's least likely class give (y - p)^T W z < 0 for every sample: the
    scores of the first scored epoch are all negative and a warning is raised (once): ``target_mismatch`` when the
    loss trains on other targets than GWA reads (its gradient points elsewhere), ``opposed_start`` when they are the
    loss's own."""
    module = Fixed()
    x = torch.randn(64, 6)
    with torch.no_grad():
        logits = module.head(module.body(x))
    y = getattr(logits, pick)(-1)
    module = _TrainsOn(getattr(logits, loss_pick)(-1))
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=logger, callbacks=[gwa], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16))
    path = os.path.join(logger.log_dir, "alerts.jsonl")
    alerts = read_alerts(path) if os.path.exists(path) else []
    said = [a for a in alerts if a.kind in ("target_mismatch", "opposed_start", "nothing_to_watch")]
    if kind == "nothing_to_watch":  # the check at the first scored step finds the gradient pointing elsewhere
        assert gwa.history == [] and [a.kind for a in said] == [kind] and said[0].severity == "warning"
        assert not gwa._targets_verified
        return
    assert [h["negative"] / h["count"] for h in gwa.history] == ([1.0, 1.0] if pick == "argmin" else [0.0, 0.0])
    assert [a.kind for a in said] == ([kind] if kind else [])
    if kind:
        assert said[0].severity == "warning" and said[0].value == 1.0
    assert gwa._targets_verified == (pick == loss_pick)


class _SequenceClassifier(pl.LightningModule):
    """A tiny ``LlamaForSequenceClassification``: its ``score`` head runs on every token and the model pools the
    logits of each sequence's last real token afterwards. Right-padded batches of different lengths; lr 0."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        self.model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, num_labels=3))
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(4, 13, (24,), generator=g)
        self.mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
        self.ids = torch.randint(1, 40, (24, 12), generator=g) * self.mask
        self.labels = torch.randint(0, 3, (24,), generator=g)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        rows = [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(self.ids, self.mask, self.labels)]
        return DataLoader(rows, batch_size=8)


def test_a_decoder_sequence_classifier_is_scored_at_its_pooled_token(tmp_path) -> None:
    # the head's logits are [B, T, C] and the labels [B]: each label goes to its sequence's last real token. It used to
    # fail ("one target per logits row is needed"), and no `head=` could fix it
    pytest.importorskip("transformers")
    module = _SequenceClassifier()
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0)
    pl.Trainer(accelerator="cpu", max_epochs=1, callbacks=[gwa], logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path)).fit(module)
    # oracle: each sequence's loss on its pooled logits, its gradient on the head's weight, cosine with -W
    w = module.model.score.weight
    cos = []
    for i in range(24):
        out = module.model(input_ids=module.ids[i:i + 1], attention_mask=module.mask[i:i + 1], labels=module.labels[i:i + 1])
        (grad,) = torch.autograd.grad(out.loss, w)
        cos.append(torch.nn.functional.cosine_similarity(-grad.reshape(-1), w.detach().reshape(-1), dim=0))
    cos = torch.stack(cos).double()
    (epoch,) = gwa.history
    assert epoch["count"] == 24
    assert epoch["mean"] == pytest.approx(float(cos.mean()), abs=1e-5)


class _IndexedTokens(Tokens):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "idx": torch.tensor(i)}


class _IndexedLM(CausalLM):
    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def test_token_scores_keep_no_run_level_suspects(tmp_path) -> None:
    # every token is scored: a sample's mean over the run would mix its tokens. The run-level file used to be written
    # with its header only (and its per-sample sums kept in checkpoints); each epoch's file lists the tokens
    from lightning_monitor.callbacks.gradient_weight_alignment import RUN_SUSPECTS_FILENAME, SUSPECTS_FILENAME

    torch.manual_seed(0)
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False, index_fn=lambda b: b["idx"])
    logger = CSVLogger(str(tmp_path), name="csv")
    pl.Trainer(accelerator="cpu", max_epochs=2, logger=logger, callbacks=[gwa], enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False).fit(
        _IndexedLM(), DataLoader(_IndexedTokens(), batch_size=8))
    assert gwa._run is None
    assert not os.path.exists(os.path.join(logger.log_dir, RUN_SUSPECTS_FILENAME))
    assert os.path.exists(os.path.join(logger.log_dir, SUSPECTS_FILENAME))


class _Tagger(pl.LightningModule):
    """A token classifier with frozen weights whose head runs sequence-first (``[T, B, C]`` logits) or batch-first,
    on the same ``[B, T]`` targets."""

    def __init__(self, sequence_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sequence_first = sequence_first
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 5)

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]  # x [B, T, 6], y [B, T] (and the samples' indices, where given)
        if self.sequence_first:
            logits = self.head(self.body(x.transpose(0, 1)))  # [T, B, 5]
            return torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), y)
        return torch.nn.functional.cross_entropy(self.head(self.body(x)).transpose(1, 2), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_sequence_first_logits_are_paired_with_their_own_targets(tmp_path) -> None:
    """Logits ``[T, B, C]`` against targets ``[B, T]``: each logits row is scored against its own token's target, as
    the batch-first twin scores it (the targets were reshaped to ``[T, B]``, pairing rows with other tokens' targets,
    silently)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 6, generator=g), torch.randint(0, 5, (32, 3), generator=g)
    means = []
    for sequence_first in (True, False):
        gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False, shift_targets=False)
        trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, callbacks=[gwa], enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(_Tagger(sequence_first), DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
        assert gwa.history and gwa.history[0]["count"] == 32 * 3
        means.append(gwa.history[0]["mean"])
    assert means[0] == pytest.approx(means[1], rel=1e-5)


def test_sequence_first_suspects_name_their_own_sample_and_token(tmp_path) -> None:
    """With `index_fn`, a sequence-first head's suspects list each token under its own sample and position, as the
    batch-first twin lists them (the index count was checked against the logits' first dimension, T: the fit failed
    with "index_fn returned 8 indices for a batch of 3 samples")."""
    import csv

    from lightning_monitor.callbacks.gradient_weight_alignment import SUSPECTS_FILENAME

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 6, generator=g), torch.randint(0, 5, (32, 3), generator=g)
    index = torch.randperm(32, generator=g) + 100  # the dataset's own sample ids
    rows = []
    for sequence_first in (True, False):
        gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False, shift_targets=False, suspects=12,
                                             index_fn=lambda batch: batch[2])
        logger = CSVLogger(str(tmp_path / str(sequence_first)))
        trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=logger, callbacks=[gwa], enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(_Tagger(sequence_first), DataLoader(torch.utils.data.TensorDataset(x, y, index), batch_size=8))
        with open(os.path.join(logger.log_dir, SUSPECTS_FILENAME), encoding="utf-8") as fh:
            listed = [(int(r["index"]), int(r["position"]), int(r["target"]), float(r["score"]))
                      for r in csv.DictReader(fh)]
        assert len(listed) == 12
        for i, pos, target, _ in listed:  # each row's target is the label of the token it names
            assert target == int(y[(index == i).nonzero()[0, 0], pos])
        rows.append(listed)
    assert [r[:3] for r in rows[0]] == [r[:3] for r in rows[1]]
    assert [r[3] for r in rows[0]] == pytest.approx([r[3] for r in rows[1]], rel=1e-5)


def _gemma2(cap: float) -> torch.nn.Module:
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                    max_position_embeddings=T, final_logit_softcapping=cap, attention_dropout=0.0)
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():  # logits in the cap's range (random init gives logits below 1)
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def test_soft_capped_logits_are_scored_through_the_cap(tmp_path) -> None:
    # Gemma 2 trains on cap * tanh(logits / cap): the head's per-token gradient is damped per class by the cap's slope;
    # the scores were those of the raw logits' softmax. Oracle: each token's head gradient by autograd through the cap
    if not hasattr(transformers, "Gemma2ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma2ForCausalLM (the soft-capped logits)")
    cap = 2.0
    gwa = GradientWeightAlignmentMonitor(warmup_epochs=0, log_histograms=False)
    module, data, alerts = run(tmp_path, gwa, lambda: _gemma2(cap))
    assert gwa._shift and gwa._softcap == cap
    # the head's output gradient is the softmax's damped by the cap's slope: its rows do not sum to 0 as they are,
    # and the head was said to be no softmax classifier ("its scores mean nothing")
    assert not [a for a in alerts if a.kind == "no_softmax_head"]
    head = module.model.get_output_embeddings()
    seen = {}
    h = head.register_forward_hook(lambda m, a, o: seen.update(z=a[0].detach(), out=o.detach()))
    with torch.no_grad():
        module.model(input_ids=data.ids)
    h.remove()
    labels = torch.cat([data.labels[:, 1:], torch.full((len(data), 1), -100)], 1)
    keep = labels != -100
    z, out, y = seen["z"][keep].double(), seen["out"][keep].double(), labels[keep]
    assert out.abs().max() > cap  # the cap bites
    w0 = head.weight.detach().double()
    oracle = []
    for zi, yi in zip(z, y):
        w = w0.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy((cap * torch.tanh(zi @ w.T / cap)).unsqueeze(0), yi.unsqueeze(0))
        (g,) = torch.autograd.grad(loss, w)
        oracle.append(float((-g * w0).sum() / (g.norm() * w0.norm())))
    oracle = torch.tensor(oracle, dtype=torch.float64)
    rec = gwa.history[0]
    assert rec["count"] == len(oracle)
    assert rec["mean"] == pytest.approx(float(oracle.mean()), rel=1e-4)
    assert rec["negative"] == float((oracle < 0).sum())
    uncapped = reference_scores(module, data, shift=True)  # the softmax of the raw logits
    assert abs(float(uncapped.mean()) - float(oracle.mean())) > 20 * 1e-4 * abs(float(oracle.mean()))
