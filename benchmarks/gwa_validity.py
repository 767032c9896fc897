"""GWA validity: does GradientWeightAlignmentMonitor's best epoch hold up on settings we did not tune on?

Issue 14, item 1. For every setting (dataset x model x optimizer), label noise (0 / 20 / 40% of the
training labels flipped to another class) and seed:

* split: 60% train (labels possibly flipped), 10% clean validation (comparison only: the monitor
  never sees it), 30% clean test;
* train ``--epochs`` epochs in a real ``Trainer.fit`` with ``GradientWeightAlignmentMonitor`` at its
  defaults (plus ``index_fn`` so it writes its suspects file);
* record test accuracy at GWA's ``best_epoch``, at validation's pick (best val accuracy, first on
  ties), at the last epoch, and the oracle (best test accuracy over epochs);
* suspects precision at k = number of flipped labels, from the suspects of GWA's best epoch;
* per epoch: GWA score, mean and excess kurtosis of the alignment scores, negative fraction, train
  loss / accuracy (against the given labels), val and test accuracy (for the early-peak analysis).

Prints a markdown table per setting and an early-peak analysis; ``--out`` also writes it to a file,
``--json`` dumps every run.

Run: ``python benchmarks/gwa_validity.py --workers 2`` (1 torch thread per worker).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# setting name -> dataset, model, optimizer
SETTINGS: dict[str, dict[str, str]] = {
    "cls20-mlp-adam": {"data": "cls20", "model": "mlp", "opt": "adam"},
    "cls20hard-mlp-sgd": {"data": "cls20hard", "model": "mlp", "opt": "sgd"},
    "digits-mlp-sgd": {"data": "digits", "model": "mlp", "opt": "sgd"},
    "digits-cnn-adam": {"data": "digits", "model": "cnn", "opt": "adam"},
    "cancer-mlp-adam": {"data": "cancer", "model": "mlp", "opt": "adam"},
    "moons-mlp-sgd": {"data": "moons", "model": "mlp", "opt": "sgd"},
}


def load(name: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn import datasets

    if name == "cls20":  # the new-user setting
        x, y = datasets.make_classification(
            n_samples=3000, n_features=20, n_informative=10, n_classes=5, class_sep=1.0, random_state=1000 + seed
        )
    elif name == "cls20hard":  # lower class separation, more redundant features
        x, y = datasets.make_classification(
            n_samples=3000, n_features=20, n_informative=8, n_redundant=6, n_classes=5, class_sep=0.6,
            random_state=2000 + seed,
        )
    elif name == "digits":
        x, y = datasets.load_digits(return_X_y=True)
        x = x / 16.0
    elif name == "cancer":
        x, y = datasets.load_breast_cancer(return_X_y=True)
    elif name == "moons":
        x, y = datasets.make_moons(n_samples=3000, noise=0.3, random_state=3000 + seed)
    else:
        raise ValueError(name)
    return x.astype(np.float32), y.astype(np.int64)


def split(name: str, seed: int, flip: float) -> dict[str, Any]:
    import torch

    x, y = load(name, seed)
    n_cls = int(y.max()) + 1
    g = np.random.default_rng(seed)
    order = g.permutation(len(y))
    n_tr, n_va = int(0.6 * len(y)), int(0.1 * len(y))
    tr, va, te = order[:n_tr], order[n_tr : n_tr + n_va], order[n_tr + n_va :]
    if name != "digits":  # standardise on the training split
        mu, sd = x[tr].mean(0), x[tr].std(0) + 1e-6
        x = (x - mu) / sd
    y_tr = y[tr].copy()
    flipped = np.zeros(n_tr, dtype=bool)
    k = int(round(flip * n_tr))
    if k:
        which = g.choice(n_tr, k, replace=False)
        y_tr[which] = (y_tr[which] + g.integers(1, n_cls, k)) % n_cls
        flipped[which] = True
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return {
        "train": (t(x[tr]), t(y_tr), torch.arange(n_tr)),
        "val": (t(x[va]), t(y[va])),
        "test": (t(x[te]), t(y[te])),
        "flipped": flipped,
        "n_cls": n_cls,
        "n_in": x.shape[1],
        # every sample (inputs as the model sees them) with its clean label, and the training rows among them: for
        # detectors that are cross-fitted on clean labels (benchmarks/gwa_suspects_ceiling.py)
        "all": (x, y, tr),
    }


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import torch.nn.functional as F
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_monitor import GradientWeightAlignmentMonitor
    from lightning_monitor.callbacks.gradient_weight_alignment import RUN_SUSPECTS_FILENAME, SUSPECTS_FILENAME

    cfg = SETTINGS[job["setting"]]
    seed, flip, epochs = job["seed"], job["flip"], job["epochs"]
    data = split(cfg["data"], seed, flip)
    n_flip = int(data["flipped"].sum())
    n_in, n_cls = data["n_in"], data["n_cls"]

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if cfg["model"] == "cnn":
                self.body = nn.Sequential(
                    nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                    nn.Linear(32 * 16, 128), nn.ReLU(),
                )
                feat = 128
            else:
                self.body = nn.Sequential(nn.Linear(n_in, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
                feat = 256
            self.head = nn.Linear(feat, n_cls)
            self.losses: list[float] = []

        def forward(self, x):
            return self.head(self.body(x))

        def training_step(self, batch, batch_idx):
            out = self(batch[0])
            if probs is not None:  # --full-scores: each sample's p(label) and logit margin, every epoch
                with torch.no_grad():
                    y = batch[1][:, None]
                    probs[self.current_epoch, batch[2]] = out.softmax(-1).gather(1, y)[:, 0].double().numpy()
                    other = out.scatter(1, y, float("-inf")).amax(1)
                    margins[self.current_epoch, batch[2]] = (out.gather(1, y)[:, 0] - other).double().numpy()
            return F.cross_entropy(out, batch[1])

        def configure_optimizers(self):
            if cfg["opt"] == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class EpochEval(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        @torch.no_grad()
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            pl_module.eval()
            row = {}
            x, y, _ = data["train"]
            out = pl_module(x)
            row["train_loss"] = float(F.cross_entropy(out, y))
            row["train_acc"] = float((out.argmax(-1) == y).float().mean())
            for tag in ("val", "test"):
                x, y = data[tag]
                row[tag] = float((pl_module(x).argmax(-1) == y).float().mean())
            pl_module.train()
            self.rows.append(row)

    probs = margins = None
    if job.get("full_scores"):
        probs = np.full((epochs, len(data["flipped"])), np.nan)
        margins = np.full((epochs, len(data["flipped"])), np.nan)
    seed_everything(seed, verbose=False)
    model = Net()
    loader = DataLoader(TensorDataset(*data["train"]), batch_size=64, shuffle=True)
    # with --full-scores every sample is a "suspect": the file then holds every sample's score of every epoch
    k = len(data["flipped"]) if job.get("full_scores") else max(n_flip, 50)
    gwa = GradientWeightAlignmentMonitor(index_fn=lambda b: b[2], suspects=k)
    ev = EpochEval()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        logger = CSVLogger(root, name="gwa")
        Trainer(
            accelerator="cpu", max_epochs=epochs, logger=logger, callbacks=[gwa, ev], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0,
        ).fit(model, loader)
        path = os.path.join(logger.log_dir, SUSPECTS_FILENAME)
        rows = list(csv.DictReader(open(path))) if os.path.exists(path) else []
        path = os.path.join(logger.log_dir, RUN_SUSPECTS_FILENAME)
        run_rows = list(csv.DictReader(open(path))) if os.path.exists(path) else []
    wall = time.perf_counter() - t0
    val = [r["val"] for r in ev.rows]
    test = [r["test"] for r in ev.rows]
    e_gwa = gwa.best_epoch
    e_val = int(np.argmax(val))
    out: dict[str, Any] = {
        **job,
        "wall": wall,
        "warmup": gwa._warmup_resolved,
        "epoch_gwa": e_gwa,
        "monitor_uncertain": gwa.pick_uncertain,  # the monitor's own word on its final pick (None: confident)
        "epoch_val": e_val,
        "epoch_oracle": int(np.argmax(test)),
        "test_gwa": test[e_gwa] if e_gwa is not None else float("nan"),
        "test_val": test[e_val],
        "test_last": test[-1],
        "test_oracle": max(test),
        "n_flip": n_flip,
        "n_train": len(data["flipped"]),
        "per_epoch": [
            {**ev.rows[i], **{k: h.get(k) for k in ("score", "mean", "kurtosis", "negative", "count")}}
            for i, h in enumerate(gwa.history)
        ],
    }
    if n_flip:
        for tag, epoch in (("gwa", e_gwa), ("last", len(test) - 1)):
            ranked = sorted((float(r["score"]), int(r["index"])) for r in rows if int(r["epoch"]) == epoch)
            flagged = [i for _, i in ranked[:n_flip]]
            out[f"precision_{tag}"] = float(data["flipped"][flagged].sum()) / n_flip
        # the monitor's run-level list (gwa_suspects_run.csv): the lowest mean scores over the run
        flagged = [int(r["index"]) for r in run_rows[:n_flip]]
        out["precision_run"] = float(data["flipped"][flagged].sum()) / n_flip
        if job.get("full_scores"):  # each sample's mean alignment over the run's epochs, the most negative k
            scores = np.full((len(test), len(data["flipped"])), np.nan)
            for r in rows:
                scores[int(r["epoch"]), int(r["index"])] = float(r["score"])
            seen = ~np.isnan(scores)
            mean = np.where(seen.any(0), np.where(seen, scores, 0.0).sum(0) / np.maximum(seen.sum(0), 1), np.inf)
            out["precision_mean"] = float(data["flipped"][np.argsort(mean)[:n_flip]].sum()) / n_flip
            # the small-loss rankings (low p(label), low margin), over the run and its first half, and the ranks of
            # the alignment and of p(label) added
            from scipy.stats import rankdata

            def precision(values):
                return float(data["flipped"][np.argsort(values)[:n_flip]].sum()) / n_flip

            half = max(1, len(test) // 2)
            for tag, m in (("prob", probs), ("margin", margins)):
                out[f"precision_{tag}_run"] = precision(m.mean(0))
                out[f"precision_{tag}_half"] = precision(m[:half].mean(0))
            out["precision_mean_and_prob"] = precision(rankdata(mean) + rankdata(probs.mean(0)))
    return out


def spearman(a, b) -> float:
    ra = np.argsort(np.argsort(np.asarray(a))).astype(float)
    rb = np.argsort(np.argsort(np.asarray(b))).astype(float)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def fmt_pt(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:+.1f}"


def report(results: list[dict[str, Any]], args, wall: float) -> str:
    lines: list[str] = []
    p = lines.append
    p(f"Command: `python benchmarks/gwa_validity.py {' '.join(sys.argv[1:])}`; {len(results)} runs, "
      f"{args.epochs} epochs each (GWA warm-up {results[0]['warmup']} epochs), wall time {wall / 60:.1f} min "
      f"({args.workers} worker(s), 1 torch thread each).")
    p("")
    p("Gaps are test accuracy at GWA's `best_epoch` minus test accuracy at the compared epoch, in points; "
      "median over seeds, [min .. max] in brackets. `first` = runs where GWA picked the first epoch after "
      "its warm-up. Precision = suspects precision at k = number of flipped labels (chance = noise rate).")
    for setting in SETTINGS:
        rs = [r for r in results if r["setting"] == setting]
        if not rs:
            continue
        p("")
        p(f"### {setting}")
        p("")
        p("| noise | runs | GWA - val pick | GWA - last | GWA - oracle | test acc GWA / val / last / oracle | "
          "epochs GWA / val / oracle | first | suspects precision |")
        p("|---|---|---|---|---|---|---|---|---|")
        for flip in args.noise:
            sub = [r for r in rs if r["flip"] == flip]
            if not sub:
                continue
            cells = []
            for other in ("val", "last", "oracle"):
                gaps = [r["test_gwa"] - r[f"test_{other}"] for r in sub]
                cells.append(f"{fmt_pt(med(gaps))} [{fmt_pt(min(gaps))} .. {fmt_pt(max(gaps))}]")
            accs = " / ".join(f"{100 * med([r[f'test_{k}'] for r in sub]):.1f}" for k in ("gwa", "val", "last", "oracle"))
            eps = " / ".join(",".join(str(r[f"epoch_{k}"]) for r in sub) for k in ("gwa", "val", "oracle"))
            first = sum(r["epoch_gwa"] == r["warmup"] for r in sub)
            prec = "-" if flip == 0 else f"{med([r['precision_gwa'] for r in sub]):.2f}"
            p(f"| {int(100 * flip)}% | {len(sub)} | {cells[0]} | {cells[1]} | {cells[2]} | {accs} | {eps} | "
              f"{first}/{len(sub)} | {prec} |")

    # pooled over settings, per noise level (the targets)
    p("")
    p("### Pooled over settings (against the targets)")
    p("")
    p("| noise | runs | median GWA - val pick | runs worse than -3 pt | of them, the monitor said uncertain | "
      "first after warm-up | median suspects precision |")
    p("|---|---|---|---|---|---|---|")
    for flip in args.noise:
        sub = [r for r in results if r["flip"] == flip]
        if not sub:
            continue
        gaps = [r["test_gwa"] - r["test_val"] for r in sub]
        worse = sum(g < -0.03 for g in gaps)
        said = sum(g < -0.03 and r.get("monitor_uncertain") is not None for g, r in zip(gaps, sub))
        first = sum(r["epoch_gwa"] == r["warmup"] for r in sub)
        prec = "-" if flip == 0 else f"{med([r['precision_gwa'] for r in sub]):.2f}"
        if flip:
            prec += f" (run-level list: {med([r['precision_run'] for r in sub]):.2f})"
        if flip and all("precision_mean" in r for r in sub):
            prec += f" (mean over the epochs: {med([r['precision_mean'] for r in sub]):.2f}"
            prec += "".join(f"; {label}: {med([r[key] for r in sub]):.2f}" for key, label in (
                ("precision_prob_run", "mean p(label)"), ("precision_prob_half", "p(label), first half"),
                ("precision_margin_half", "margin, first half"), ("precision_mean_and_prob", "both ranks")))
            prec += ")"
        p(f"| {int(100 * flip)}% | {len(sub)} | {fmt_pt(med(gaps))} | {worse} | {said}/{worse} | {first}/{len(sub)} | "
          f"{prec} |")

    # a confidence signal the monitor could emit: is the pick a boundary maximum (first window epoch while
    # the score was still falling into the window), and how far is the best score above the later ones?
    p("")
    p("### Would a boundary / flatness flag have warned? (candidate confidence signal)")
    p("")
    p("`boundary` = GWA's best epoch is the first windowed epoch and the score at the epoch before it was "
      "higher (the maximum lies in the warm-up, the window only truncates a falling curve). "
      "`prominence` = (best score - best score >= 3 epochs away from the best epoch) / |best score|. "
      "Gap = GWA - val pick.")
    p("")
    p("| flag | runs | median GWA - val pick | runs worse than -3 pt | worst |")
    p("|---|---|---|---|---|")
    for flag in (True, False):
        sub = [r for r in results if is_boundary(r) == flag]
        if not sub:
            continue
        gaps = [r["test_gwa"] - r["test_val"] for r in sub]
        p(f"| boundary={flag} | {len(sub)} | {fmt_pt(med(gaps))} | {sum(g < -0.03 for g in gaps)} | {fmt_pt(min(gaps))} |")

    # per-run confidence signals (computable by the monitor from its own history) against the gap
    p("")
    p("Per-run flags the monitor could compute from its own history (no validation data). `memorised`: the "
      "share of negative scores at the pick is < 0.5 x its value at the window's first epoch. `spike`: the best "
      "score is > 1.25 x the score of both neighbouring epochs (a one-epoch kurtosis excursion).")
    p("")
    p("| signal | flagged runs | median gap flagged | worse than -3 pt flagged | median gap not flagged | "
      "worse than -3 pt not flagged |")
    p("|---|---|---|---|---|---|")
    for name, fn in SIGNALS.items():
        flagged = [r for r in results if fn(r)]
        rest = [r for r in results if not fn(r)]
        g1 = [r["test_gwa"] - r["test_val"] for r in flagged]
        g0 = [r["test_gwa"] - r["test_val"] for r in rest]
        p(f"| {name} | {len(flagged)}/{len(results)} | {fmt_pt(med(g1))} | {sum(g < -0.03 for g in g1)} | "
          f"{fmt_pt(med(g0))} | {sum(g < -0.03 for g in g0)} |")

    # other selection rules replayed on the same per-epoch curves (post hoc: on these settings, so tuning)
    p("")
    p("### Other selection rules replayed on the same curves (post hoc, i.e. chosen on these runs)")
    p("")
    p("| rule | noise | median gap to val pick | runs worse than -3 pt | median gap to oracle |")
    p("|---|---|---|---|---|")
    for name, fn in RULES.items():
        for flip in args.noise:
            sub = [r for r in results if r["flip"] == flip]
            gaps, gaps_o = [], []
            for r in sub:
                e = fn(r)
                if e is None:
                    continue
                t = r["per_epoch"][e]["test"]
                gaps.append(t - r["test_val"])
                gaps_o.append(t - r["test_oracle"])
            p(f"| {name} | {int(100 * flip)}% | {fmt_pt(med(gaps))} | {sum(g < -0.03 for g in gaps)}/{len(gaps)} | "
              f"{fmt_pt(med(gaps_o))} |")

    # does the score track test accuracy over the window? rank correlations, and where the raw peak is
    p("")
    p("### Does the score track test accuracy? (Spearman over windowed epochs, median over seeds)")
    p("")
    p("| setting | noise | rho(score, test) | rho(mean gamma, test) | rho(-kurtosis, test) | raw score argmax "
      "over all epochs (incl. warm-up) |")
    p("|---|---|---|---|---|---|")
    for setting in SETTINGS:
        for flip in args.noise:
            sub = [r for r in results if r["setting"] == setting and r["flip"] == flip]
            if not sub:
                continue
            cells = []
            for key, sign in (("score", 1), ("mean", 1), ("kurtosis", -1)):
                rhos = []
                for r in sub:
                    pts = [(sign * row[key], row["test"]) for row in r["per_epoch"][r["warmup"]:] if row[key] is not None]
                    if len(pts) > 3:
                        rhos.append(spearman(*zip(*pts)))
                cells.append(f"{med(rhos):+.2f}")
            peaks = []
            for r in sub:
                sc = [(row["score"], e) for e, row in enumerate(r["per_epoch"]) if row["score"] is not None]
                peaks.append(str(max(sc)[1]) if sc else "-")
            p(f"| {setting} | {int(100 * flip)}% | {' | '.join(cells)} | {','.join(peaks)} |")

    # early-peak analysis: per-epoch curves of a few clean runs
    p("")
    p("### Early peak on clean data: per-epoch curves (seed 0)")
    for setting in args.trace:
        sub = [r for r in results if r["setting"] == setting and r["flip"] == 0 and r["seed"] == 0]
        if not sub:
            continue
        r = sub[0]
        p("")
        p(f"`{setting}`, 0% noise, seed 0: GWA best epoch {r['epoch_gwa']} (warm-up {r['warmup']}), val pick "
          f"{r['epoch_val']}, oracle {r['epoch_oracle']}")
        p("")
        p("| epoch | GWA score | mean gamma | excess kurtosis | neg. fraction | train loss | train acc | test acc |")
        p("|---|---|---|---|---|---|---|---|")
        for e, row in enumerate(r["per_epoch"]):
            if e > 12 and e % 4 != 3 and e != len(r["per_epoch"]) - 1:
                continue
            sc = "n/a" if row["score"] is None else f"{row['score']:.4f}"
            mn = "n/a" if row["mean"] is None else f"{row['mean']:.4f}"
            ku = "n/a" if row["kurtosis"] is None else f"{row['kurtosis']:.2f}"
            nf = row["negative"] / max(row["count"], 1)
            p(f"| {e} | {sc} | {mn} | {ku} | {nf:.3f} | {row['train_loss']:.3f} | {row['train_acc']:.3f} | "
              f"{row['test']:.3f} |")

    # correlation across clean runs: epoch-to-epoch change of mean and kurtosis after the warm-up
    p("")
    p("### Early peak: what drives the fall of the score after the warm-up (clean runs)")
    p("")
    p("Between the first windowed epoch w and the oracle epoch o (clean runs with o > w): change of the score, "
      "of its numerator (mean gamma) and of its denominator (kurtosis + 1.2).")
    p("")
    p("| setting | runs | score(o)/score(w) | mean(o)/mean(w) | (kurt+1.2)(o)/(kurt+1.2)(w) | test acc o - w |")
    p("|---|---|---|---|---|---|")
    for setting in SETTINGS:
        sub = [r for r in results if r["setting"] == setting and r["flip"] == 0 and r["epoch_oracle"] > r["warmup"]]
        sub = [r for r in sub if all(r["per_epoch"][e]["score"] is not None for e in (r["warmup"], r["epoch_oracle"]))]
        if not sub:
            continue
        def ratio(r, k, off=0.0):
            a, b = r["per_epoch"][r["warmup"]][k], r["per_epoch"][r["epoch_oracle"]][k]
            return (b + off) / (a + off)
        p(f"| {setting} | {len(sub)} | {med([ratio(r, 'score') for r in sub]):.2f} | "
          f"{med([ratio(r, 'mean') for r in sub]):.2f} | {med([ratio(r, 'kurtosis', 1.2) for r in sub]):.2f} | "
          f"{fmt_pt(med([r['per_epoch'][r['epoch_oracle']]['test'] - r['per_epoch'][r['warmup']]['test'] for r in sub]))} |")
    return "\n".join(lines)


def _window(r: dict[str, Any], start: int | None = None) -> list[tuple[int, float]]:
    w = r["warmup"] if start is None else start
    return [(e, row["score"]) for e, row in enumerate(r["per_epoch"]) if e >= w and row["score"] is not None]


def prominence(r: dict[str, Any], gap: int = 3) -> float:
    """(best - best score at least ``gap`` epochs away from the best epoch) / |best|: small = a rival peak."""
    win = _window(r)
    if not win:
        return float("nan")
    e_best, best = max(win, key=lambda t: t[1])
    rivals = [s for e, s in win if abs(e - e_best) >= gap]
    return (best - max(rivals)) / abs(best) if rivals else float("inf")


def argmax_rule(key: str = "score", frac: float | None = None, smooth: int = 1):
    def rule(r: dict[str, Any]) -> int | None:
        n = len(r["per_epoch"])
        start = r["warmup"] if frac is None else math.ceil(frac * n)
        vals = [row[key] for row in r["per_epoch"]]
        cand = []
        for e in range(start, n):
            window = [v for v in vals[max(0, e - smooth + 1) : e + 1] if v is not None]
            if vals[e] is not None and window:
                cand.append((sum(window) / len(window), e))
        return max(cand)[1] if cand else None

    return rule


def after_dip_rule(r: dict[str, Any]) -> int | None:
    """finetune=True's window (after GWA's first dip, and after the warm-up) replayed on the curve."""
    prev, fell, dip = None, False, None
    for e, row in enumerate(r["per_epoch"]):
        sc = row["score"]
        if sc is None:
            continue
        if prev is not None:
            if sc < prev[1]:
                fell = True
            elif sc > prev[1] and fell and dip is None:
                dip = prev[0]
        prev = (e, sc)
    if dip is None:
        return None
    cand = [(sc, e) for e, sc in _window(r, max(dip, r["warmup"]))]
    return max(cand)[1] if cand else None


RULES = {
    "default: max score after 10% (monitor)": argmax_rule(),
    "max score after 25%": argmax_rule(frac=0.25),
    "max 3-epoch mean score after 10%": argmax_rule(smooth=3),
    "max mean gamma (numerator only) after 10%": argmax_rule("mean"),
    "max score after first dip (finetune=True window)": after_dip_rule,
    "last epoch": lambda r: len(r["per_epoch"]) - 1,
}

def _neg_frac(r: dict[str, Any], e: int) -> float:
    row = r["per_epoch"][e]
    return row["negative"] / max(row["count"], 1)


def memorised(r: dict[str, Any], ratio: float = 0.5) -> bool:
    """The share of negative scores at the pick fell below ``ratio`` x its value when the window opened:
    samples that fought the labels stopped fighting (on noisy labels: memorisation)."""
    e = r["epoch_gwa"]
    return e is not None and _neg_frac(r, e) < ratio * _neg_frac(r, r["warmup"])


def spike(r: dict[str, Any], factor: float = 1.25) -> bool:
    """The best score is more than ``factor`` x the defined score of each neighbouring epoch."""
    e = r["epoch_gwa"]
    pe = r["per_epoch"]
    best = pe[e]["score"]  # None for a pick of bimodal scores (no GWA): no spike
    nb = [pe[i]["score"] for i in (e - 1, e + 1) if 0 <= i < len(pe) and pe[i]["score"] is not None]
    return best is not None and bool(nb) and all(best > factor * x for x in nb)


def uncertain(r: dict[str, Any]) -> bool:
    return is_boundary(r) or memorised(r) or spike(r)


SIGNALS = {
    "memorised (neg. fraction at pick < 0.5 x at window start)": memorised,
    "spike (best > 1.25 x both neighbours)": spike,
    "boundary or spike": lambda r: is_boundary(r) or spike(r),
    "UNCERTAIN = boundary or memorised or spike": uncertain,
    "boundary pick (max at first windowed epoch, score falling into it)": lambda r: is_boundary(r),
    "pick at first windowed epoch": lambda r: r["epoch_gwa"] == r["warmup"],
    "prominence < 5% (rival peak >= 3 epochs away within 5%)": lambda r: prominence(r) < 0.05,
    "boundary or prominence < 5%": lambda r: is_boundary(r) or prominence(r) < 0.05,
}


def is_boundary(r: dict[str, Any]) -> bool:
    w = r["warmup"]
    if r["epoch_gwa"] != w or w == 0:
        return False
    prev, cur = r["per_epoch"][w - 1]["score"], r["per_epoch"][w]["score"]
    return prev is not None and cur is not None and prev > cur


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--noise", nargs="+", type=float, default=[0.0, 0.2, 0.4])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0,
                    help="run seeds first-seed .. first-seed + seeds - 1 (e.g. held-out seeds)")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--full-scores", action="store_true",
                    help="write every sample's score each epoch and also report the precision of the per-sample "
                         "mean over the epochs, and of the small-loss rankings (each sample's p(label) and logit "
                         "margin, over the run and its first half)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--trace", nargs="+", default=["cls20-mlp-adam", "cls20hard-mlp-sgd", "digits-mlp-sgd"])
    ap.add_argument("--out", default=None, help="also write the report (markdown) here")
    ap.add_argument("--json", default=None, help="dump every run (with per-epoch curves) here")
    ap.add_argument("--from-json", default=None, help="re-render the report from a --json dump (no training)")
    args = ap.parse_args()
    if args.from_json:
        results = json.load(open(args.from_json))
        text = report(results, args, float("nan"))
        print(text)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text + "\n")
        return
    jobs = [
        {"setting": s, "flip": f, "seed": seed, "epochs": args.epochs, "full_scores": args.full_scores}
        for seed in range(args.first_seed, args.first_seed + args.seeds) for s in args.settings for f in args.noise
    ]
    t0 = time.perf_counter()
    results = []
    if args.workers > 1:
        import multiprocessing as mp

        with ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as pool:
            for r in pool.map(run_one, jobs):
                results.append(r)
                print(f"{r['setting']} noise={r['flip']} seed={r['seed']}: GWA ep {r['epoch_gwa']} "
                      f"({100 * r['test_gwa']:.1f}) val ep {r['epoch_val']} ({100 * r['test_val']:.1f}) "
                      f"{r['wall']:.0f}s", file=sys.stderr, flush=True)
    else:
        for job in jobs:
            results.append(run_one(job))
    wall = time.perf_counter() - t0
    if args.json:  # first: the runs are kept even if the report fails
        with open(args.json, "w") as fh:
            json.dump(results, fh)
    text = report(results, args, wall)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
