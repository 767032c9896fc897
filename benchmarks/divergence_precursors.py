"""Divergence precursors: does any cheap on-device signal warn of a loss explosion before it happens, and
never on a healthy run or a matched control? Runs the scenarios of ``benchmarks/divergence_zoo.py``
(unguarded) with a recorder of the candidate signals below, and evaluates a threshold rule on each.

Signals, per optimizer step ``t`` (before the update unless said otherwise; NaN where undefined):

1. ``adam_v_lag_rms`` (AdamW runs only): the AdamW second moment lagging the squared gradient, which
   Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities",
   arXiv 2309.14322) see 1-8 iterations before a loss spike. ``sqrt(mean_i g_i^2 / (sqrt(v_hat_i) + eps)^2)``
   over every element of every parameter, with ``v_hat = exp_avg_sq / (1 - beta2^k)`` the optimizer's
   bias-corrected estimate after its ``k`` previous steps, i.e. before it sees ``g``. About 1 when ``v`` is
   up to date. ``adam_v_lag_frac``: the fraction of elements with ``g_i^2 > 10 v_hat_i``.
2. ``update_ratio``: ``||W_{t+1} - W_t|| / (||W_t|| lr_t)`` over all parameters together (global);
   ``update_ratio_max``: the same per weight matrix (``dim >= 2``), max over matrices. With SGD it is the
   momentum buffer's size relative to the weights; with AdamW the update's RMS in units of the LR times
   ``sqrt(numel) / ||W||``: scales two orders of magnitude apart, so each optimizer gets its own ``T``
   (the ``[AdamW]`` and ``[SGD]`` rows are separate candidates).
3. ``attn_logit_max`` (GPT families): the largest causal attention logit ``q.k / sqrt(d_head)`` over
   layers, heads and the step's batch, recomputed in fp32 from each attention block's input (forward
   pre-hook) and its ``q_proj`` / ``k_proj`` (attention logit growth: Dehghani et al. 2023; Wortsman et al.).
4. ``gnorm_ema``: EMA (beta 0.9) of the global gradient norm (fp32, before clipping) divided by the median
   of that EMA over steps 10..29; defined from step 30 on.
5. ``loss_creep``: EMA (beta 0.9) of the loss divided by the lowest value of that EMA so far; from step 20 on.
6. ``logz_rms`` (GPT families): ``sqrt(mean log^2 Z)`` over the step's tokens, ``log Z`` the log-sum-exp of
   the output logits: what PaLM's z-loss penalises (output logit divergence: Chowdhery et al. 2022;
   Wortsman et al.).

Non-finite values are skipped by the EMAs (which keep their state); non-finite losses and gradients are
a separate rule's business. Every signal is ignored over the first ``WARMUP`` = 20 steps (about
``1 / (1 - beta2)`` for AdamW's beta2 0.95): there AdamW's first updates are sign-like (update ratio up to
~90) and ``v_hat`` averages a handful of gradients (lag fraction up to 0.85), which a first run showed to set
every calm maximum; a run that explodes within 20 steps (``gpt_ln_const_high``, at step 2) is out of reach
of any of these precursors.

Rule and threshold: a signal fires at the third of 3 consecutive steps with a finite value above ``T``.
``T`` is chosen on the **tune** split only: the smallest ``T`` at which no tune healthy or control run of
the signal's scope fires (the largest, over those runs, of the 3-step level ``max_t min(s_{t-2}, s_{t-1},
s_t)``), times 1.1; the held-out split is scored with that ``T`` unchanged. Baselines, with their fixed
rules and the zoo's functions, on the same runs: Lightning's ``SpikeDetection`` (defaults, replayed on
the loss trace) and the naive rule (gradient norm non-finite, or after 10 steps above 5 x the median of
the previous ones).

Explosion step: the zoo's (first step at or after the trigger whose loss is non-finite or above 2 x L0).
Lead = explosion step - alarm step. Injected bad batches (NaN / Inf / huge inputs, a NaN loss) cannot be
foreseen: those diverging runs are left out of the diverging counts and reported in their own column;
their controls (no injection) count as controls.

Tables:

* Summary, per signal and split: T; the largest tune-calibration level; diverging runs alarmed strictly
  before the explosion (lead >= 1) with the lead's median / min; alarmed by the explosion step (lead >= 0,
  the zoo's "caught"); alarmed at all; healthy + control runs alarmed (false alarms); injection runs alarmed.
* Separation, per signal and split: the per-run max of the signal over healthy + control runs (largest,
  with its run, and median; and the largest 3-step level, the value ``T`` must exceed to stay silent on
  them), against each diverging run's max over the 10 steps before its explosion
  (steps E-10..E-1; "-" when the run explodes before any defined value). Separation means the diverging
  values sit above every calm value; the rule also needs them to stay there for 3 steps.
* Alarms per run: each signal's first alarm, ``step (lead)`` on diverging runs, ``FA@step`` on calm runs. A
  diverging run is its control up to the trigger, so an alarm before the trigger fires in the control too.

Run: python benchmarks/divergence_precursors.py [--split tune|heldout|all] [--workers 2] [--markdown]
     [--json out.json]
(``--split heldout`` still trains the tune runs, which set the thresholds, and reports held-out only.)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from divergence_zoo import (  # noqa: E402
    BY_NAME, SCENARIOS, Scenario, explosion, naive_gnorm_step, print_table, run, spike_detection_step, trigger_step)
from gpt import Attention  # noqa: E402  (examples/, on the path once zoo_models is imported)

RAW = ("adam_v_lag_rms", "adam_v_lag_frac", "update_ratio", "update_ratio_max", "attn_logit_max", "logz_rms")
CONSECUTIVE, MARGIN, PRE_WINDOW, WARMUP = 3, 1.1, 10, 20
GNORM_REF, CREEP_START = (10, 30), 20

# ----------------------------------------------------------------------------- recording


class PrecursorRecorder(Callback):
    """Per step, the raw signals of ``RAW`` (NaN where a signal does not apply or the step lacks it)."""

    def __init__(self) -> None:
        self.trace: dict[str, list[float]] = {key: [] for key in RAW}
        self._row: dict[str, float] = {}
        self._params: list[Tensor] = []
        self._before: list[Tensor] = []
        self._lr = math.nan

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for module in pl_module.modules():
            if isinstance(module, Attention):
                module.register_forward_pre_hook(self._attention_hook)
        head = getattr(getattr(pl_module, "model", None), "lm_head", None)
        if head is not None:
            head.register_forward_hook(self._logits_hook)

    @torch.no_grad()
    def _attention_hook(self, module: Attention, args: tuple[Tensor, ...]) -> None:
        x = args[0].detach().float()
        b, t, d = x.shape
        h = module.n_head

        def heads(proj: torch.nn.Linear) -> Tensor:
            bias = None if proj.bias is None else proj.bias.float()
            return F.linear(x, proj.weight.float(), bias).view(b, t, h, d // h).transpose(1, 2)

        with torch.autocast("cpu", enabled=False):
            logits = heads(module.q_proj) @ heads(module.k_proj).transpose(-1, -2) / math.sqrt(d // h)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        top = float(logits.masked_fill(~causal, -math.inf).amax())
        self._row["attn_logit_max"] = max(self._row.get("attn_logit_max", -math.inf), top)

    @torch.no_grad()
    def _logits_hook(self, module: torch.nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        logz = torch.logsumexp(out.detach().float(), dim=-1)
        self._row["logz_rms"] = float(logz.pow(2).mean().sqrt())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._row, self._params, self._before = {}, [], []
        self._lr = float(trainer.optimizers[0].param_groups[0]["lr"])  # the LR of this step's update

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._before = [p.detach().float().clone() for p in self._params]
        total, over, count = 0.0, 0.0, 0
        for group in optimizer.param_groups:
            beta2, eps = group.get("betas", (0.0, 0.0))[1], group.get("eps", 0.0)
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                if p.grad is None or "exp_avg_sq" not in state or float(state["step"]) < 1:
                    continue
                v_hat = state["exp_avg_sq"].float() / (1.0 - beta2 ** float(state["step"]))
                g2 = p.grad.detach().float().pow(2)
                total += float((g2 / (v_hat.sqrt() + eps).pow(2)).sum())
                over += float((g2 > 10.0 * v_hat).sum())
                count += g2.numel()
        if count:
            self._row["adam_v_lag_rms"] = math.sqrt(total / count) if math.isfinite(total) else math.nan
            self._row["adam_v_lag_frac"] = over / count

    @torch.no_grad()
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._before:
            diff = [float(torch.linalg.vector_norm(p.detach().float() - w)) for p, w in zip(self._params, self._before)]
            size = [float(torch.linalg.vector_norm(w)) for w in self._before]
            self._row["update_ratio"] = math.hypot(*diff) / (math.hypot(*size) * self._lr)
            ratios = [dw / (w * self._lr) for dw, w, p in zip(diff, size, self._before) if p.dim() >= 2 and w > 0]
            self._row["update_ratio_max"] = max(ratios, default=math.nan)
        for key in RAW:
            self.trace[key].append(self._row.get(key, math.nan))


def _quiet() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _task(name: str) -> tuple[str, dict[str, Any]]:
    """One unguarded run of scenario ``name`` with the zoo's recorder and ours."""
    recorder = PrecursorRecorder()
    out = run(BY_NAME[name], lambda: [recorder])
    out["signals"] = recorder.trace
    return name, out


# ----------------------------------------------------------------------------- signals and rules


def ema(xs: list[float], beta: float = 0.9) -> list[float]:
    """EMA over the finite values of ``xs`` (NaN at the non-finite ones, whose step it skips)."""
    out, state = [], math.nan
    for x in xs:
        if math.isfinite(x):
            state = x if math.isnan(state) else beta * state + (1 - beta) * x
            out.append(state)
        else:
            out.append(math.nan)
    return out


def gnorm_ema(gnorms: list[float]) -> list[float]:
    """EMA of the gradient norm / its median over steps ``GNORM_REF``; from the window's end on."""
    smooth = ema(gnorms)
    lo, hi = GNORM_REF
    ref = [x for x in smooth[lo:hi] if math.isfinite(x)]
    if not ref or statistics.median(ref) <= 0:
        return [math.nan] * len(gnorms)
    level = statistics.median(ref)
    return [x / level if i >= hi else math.nan for i, x in enumerate(smooth)]


def loss_creep(losses: list[float]) -> list[float]:
    """EMA of the loss / the lowest value of that EMA so far; from step ``CREEP_START`` on."""
    out, low = [], math.inf
    for i, x in enumerate(ema(losses)):
        low = min(low, x) if math.isfinite(x) else low
        out.append(x / low if i >= CREEP_START and math.isfinite(x) and low > 0 else math.nan)
    return out


@dataclass(frozen=True)
class Candidate:
    """A signal: its key, its label, its scope and how it is computed from a run."""

    key: str
    label: str
    applies: Callable[[Scenario], bool]
    compute: Callable[[dict[str, Any]], list[float]]


def _adamw(s: Scenario) -> bool:
    return s.optimizer == "adamw"


def _sgd(s: Scenario) -> bool:
    return s.optimizer == "sgd"


def _gpt(s: Scenario) -> bool:
    return s.family.startswith("gpt")


def _any(s: Scenario) -> bool:
    return True


def _raw(key: str) -> Callable[[dict[str, Any]], list[float]]:
    return lambda out: out["signals"][key]


CANDIDATES = [
    Candidate("adam_v_lag_rms", "1a AdamW v lag: RMS g/sqrt(v_hat)", _adamw, _raw("adam_v_lag_rms")),
    Candidate("adam_v_lag_frac", "1b AdamW v lag: frac g^2 > 10 v_hat", _adamw, _raw("adam_v_lag_frac")),
    Candidate("update_ratio_adamw", "2a update / (weight x LR), global [AdamW]", _adamw, _raw("update_ratio")),
    Candidate("update_ratio_sgd", "2a update / (weight x LR), global [SGD]", _sgd, _raw("update_ratio")),
    Candidate("update_ratio_max_adamw", "2b update / (weight x LR), max matrix [AdamW]", _adamw,
              _raw("update_ratio_max")),
    Candidate("update_ratio_max_sgd", "2b update / (weight x LR), max matrix [SGD]", _sgd, _raw("update_ratio_max")),
    Candidate("attn_logit_max", "3 max attention logit", _gpt, _raw("attn_logit_max")),
    Candidate("gnorm_ema", "4 grad-norm EMA / early median", _any, lambda out: gnorm_ema(out["trace"]["gnorm"])),
    Candidate("loss_creep", "5 loss EMA / its min so far", _any, lambda out: loss_creep(out["trace"]["loss"])),
    Candidate("logz_rms", "6 output RMS log Z", _gpt, _raw("logz_rms")),
]


def _spike(out: dict[str, Any]) -> Optional[int]:
    return spike_detection_step(out["trace"]["loss"], out["trace"]["batch"])


def _naive(out: dict[str, Any]) -> Optional[int]:
    return naive_gnorm_step(out["trace"]["gnorm"])


BASELINES = {"spike": ("SpikeDetection (zoo replay)", _spike), "naive": ("naive grad norm 5x median", _naive)}


def _windows(xs: list[float]) -> list[tuple[int, float]]:
    """(step, min over the ``CONSECUTIVE`` steps ending there) for the windows of finite values."""
    return [(i, min(xs[i + 1 - CONSECUTIVE:i + 1])) for i in range(CONSECUTIVE - 1, len(xs))
            if all(math.isfinite(x) for x in xs[i + 1 - CONSECUTIVE:i + 1])]


def level(xs: list[float]) -> Optional[float]:
    """The smallest threshold the rule does not fire at on ``xs`` (None: no finite window)."""
    return max((m for _, m in _windows(xs)), default=None)


def first_alarm(xs: list[float], threshold: float) -> Optional[int]:
    """The first step closing ``CONSECUTIVE`` finite values above ``threshold``."""
    return next((i for i, m in _windows(xs) if m > threshold), None)


def _finite_max(xs: list[float]) -> Optional[float]:
    return max((x for x in xs if math.isfinite(x)), default=None)


# ----------------------------------------------------------------------------- evaluation


def evaluate(results: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per run: the explosion step and each signal's values and alarm; per signal: its tuned threshold."""
    rows = []
    for s in SCENARIOS:
        if s.name not in results:
            continue
        out = results[s.name]
        row: dict[str, Any] = {"name": s.name, "split": s.split, "kind": s.kind, "family": s.family,
                               "optimizer": s.optimizer, "injection": s.injection is not None,
                               "explosion": None, "signals": {}}
        if s.kind == "diverging":
            row["trigger"] = trigger_step(s, BY_NAME[s.pairs])
            row["explosion"] = explosion(out["trace"]["loss"], row["trigger"], s.injection is not None)[1]
        for c in CANDIDATES:
            if c.applies(s):
                xs = [math.nan if i < WARMUP else float(x) for i, x in enumerate(c.compute(out))]
                e = row["explosion"]
                pre = _finite_max(xs[max(0, e - PRE_WINDOW):e]) if e is not None else None
                row["signals"][c.key] = {"values": xs, "level": level(xs), "max": _finite_max(xs), "pre": pre}
        for key, (_, rule) in BASELINES.items():
            row["signals"][key] = {"alarm": rule(out)}
        rows.append(row)
    tuned: dict[str, dict[str, Any]] = {}
    for c in CANDIDATES:
        calm = [(r["signals"][c.key]["level"], r["name"]) for r in rows
                if r["split"] == "tune" and r["kind"] != "diverging" and c.key in r["signals"]
                and r["signals"][c.key]["level"] is not None]
        top = max(calm, default=None)
        tuned[c.key] = {"threshold": MARGIN * top[0] if top else None, "level": top[0] if top else None,
                        "from": top[1] if top else None}
        for r in rows:
            sig = r["signals"].get(c.key)
            if sig is not None:
                threshold = tuned[c.key]["threshold"]
                sig["alarm"] = None if threshold is None else first_alarm(sig["values"], threshold)
    return rows, tuned


def _lead(r: dict[str, Any], alarm: Optional[int]) -> Optional[int]:
    return None if alarm is None or r["explosion"] is None else r["explosion"] - alarm


def _g(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"


def _frac(n: int, d: int) -> str:
    return f"{n}/{d}" if d else "-"


def _labels() -> list[tuple[str, str]]:
    return [(c.key, c.label) for c in CANDIDATES] + [(k, v[0]) for k, v in BASELINES.items()]


def summary_table(rows: list[dict[str, Any]], tuned: dict[str, dict[str, Any]],
                  splits: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["signal", "split", "T (tune)", "tune calm level (run)", "diverging: alarm before explosion (lead >= 1)",
            "lead median / min", "alarm by explosion (lead >= 0)", "alarm at all", "healthy + control alarmed",
            "injection runs alarmed"]
    body = []
    for key, label in _labels():
        for split in splits:
            part = [r for r in rows if r["split"] == split and key in r["signals"]]
            div = [r for r in part if r["kind"] == "diverging" and not r["injection"]]
            inj = [r for r in part if r["kind"] == "diverging" and r["injection"]]
            calm = [r for r in part if r["kind"] != "diverging"]
            leads = [_lead(r, r["signals"][key]["alarm"]) for r in div]
            before = [x for x in leads if x is not None and x >= 1]
            t = tuned.get(key)
            body.append([label, split, _g(t["threshold"]) if t else "fixed rule",
                         f"{_g(t['level'])} ({t['from']})" if t else "-",
                         _frac(len(before), len(div)),
                         f"{statistics.median(before):g} / {min(before)}" if before else "-",
                         _frac(sum(x is not None and x >= 0 for x in leads), len(div)),
                         _frac(sum(r["signals"][key]["alarm"] is not None for r in div), len(div)),
                         _frac(sum(r["signals"][key]["alarm"] is not None for r in calm), len(calm)),
                         _frac(sum(r["signals"][key]["alarm"] is not None for r in inj), len(inj))])
    return head, body


def separation_table(rows: list[dict[str, Any]], tuned: dict[str, dict[str, Any]],
                     splits: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["signal", "split", "T", "healthy + control per-run max: largest (run)", "median",
            "healthy + control 3-step level: largest (run)",
            f"diverging: max over the {PRE_WINDOW} steps before the explosion"]
    body = []
    for c in CANDIDATES:
        for split in splits:
            part = [r for r in rows if r["split"] == split and c.key in r["signals"]]
            calm = [(r["signals"][c.key]["max"], r["name"]) for r in part
                    if r["kind"] != "diverging" and r["signals"][c.key]["max"] is not None]
            div = [f"{r['name']}: {_g(r['signals'][c.key]['pre'])}" for r in part
                   if r["kind"] == "diverging" and not r["injection"]]
            levels = [(r["signals"][c.key]["level"], r["name"]) for r in part
                      if r["kind"] != "diverging" and r["signals"][c.key]["level"] is not None]
            top, top_level = max(calm, default=None), max(levels, default=None)
            body.append([c.label, split, _g(tuned[c.key]["threshold"]), f"{_g(top[0])} ({top[1]})" if top else "-",
                         _g(statistics.median(v for v, _ in calm)) if calm else "-",
                         f"{_g(top_level[0])} ({top_level[1]})" if top_level else "-", "; ".join(div) or "-"])
    return head, body


def alarm_table(rows: list[dict[str, Any]], split: str) -> tuple[list[str], list[list[str]]]:
    labels = _labels()
    head = ["scenario", "kind", "explosion"] + [label for _, label in labels]
    body = []
    for r in rows:
        if r["split"] != split:
            continue
        cells = []
        for key, _ in labels:
            if key not in r["signals"]:
                cells.append("n/a")
                continue
            alarm = r["signals"][key]["alarm"]
            lead = _lead(r, alarm)
            if alarm is None:
                cells.append("-" if r["kind"] != "diverging" else "miss")
            elif r["kind"] != "diverging":
                cells.append(f"FA@{alarm}")
            else:
                cells.append(f"{alarm} ({lead:+d})" if lead is not None else str(alarm))
        kind = r["kind"] + (" (injection)" if r["injection"] else "")
        body.append([r["name"], kind, "-" if r["explosion"] is None else str(r["explosion"])] + cells)
    return head, body


# ----------------------------------------------------------------------------- main


def _cost(s: Scenario) -> float:
    return s.steps * (3.0 if s.family.startswith("gpt") else 1.5 if s.family == "cnn" else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", choices=("tune", "heldout", "all"), default="all")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", default=None, help="write thresholds, per-run alarms and signal traces here")
    args = parser.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    start = time.perf_counter()

    splits = ["tune", "heldout"] if args.split == "all" else [args.split]
    names = [s.name for s in sorted(SCENARIOS, key=_cost, reverse=True) if s.split in {"tune", *splits}]
    results: dict[str, dict[str, Any]] = {}
    with mp.get_context("spawn").Pool(args.workers, initializer=_quiet) as pool:
        for name, out in pool.imap_unordered(_task, names):
            results[name] = out
    rows, tuned = evaluate(results)

    print_table("Summary (lead = explosion step - alarm step; diverging excludes injected bad batches)",
                summary_table(rows, tuned, splits), args.markdown)
    print_table("Separation: calm runs' per-run max vs diverging runs just before their explosion",
                separation_table(rows, tuned, splits), args.markdown)
    for split in splits:
        print_table(f"Alarms per run, {split} (step (lead); FA = false alarm; n/a = out of the signal's scope)",
                    alarm_table(rows, split), args.markdown)
    errors = [f"{n}: {o['error']}" for n, o in results.items() if o["error"]]
    if errors:
        print("\nrun errors: " + "; ".join(errors))
    print(f"\ncommand: {command}")
    print(f"torch {torch.__version__}, lightning {pl.__version__}, {args.workers} workers x 1 thread; "
          f"{len(results)} runs, {sum(o['seconds'] for o in results.values()):.0f} s of training; "
          f"wall time {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"command": command, "thresholds": tuned, "rows": rows}, fh, default=str)


if __name__ == "__main__":
    main()
