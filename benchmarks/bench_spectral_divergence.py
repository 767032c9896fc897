"""Calibration benchmark of SpectralAlignmentMonitor: does spectral alignment warn before a loss
explosion, earlier than loss-spike and gradient-norm rules, and never on a healthy run?

Trains the example GPT (examples/gpt.py; 2 layers, d_model 64, CPU, one thread) in healthy and in
diverging settings. In every run, in the same process:

* the real :class:`~lightning_monitor.SpectralAlignmentMonitor` (``every_n_steps=--every``) raises its
  alerts through the alert hub (its first warning and critical alert are reported);
* a recorder measures, every step, the loss, the gradient norm and per layer the SA statistics and the
  variants the theory suggests: sign diversity of the outputs' alignment with ``u_1``, of the output
  gradients' alignment with ``u_1``, the coherence of the rank-one gradient terms along ``u_1 v_1^T``,
  the alignment of each optimizer update with ``u_1 v_1^T`` and the top singular value ``sigma_1``.
  Rules on these series are evaluated offline at the monitor's cadence.

Definitions (all steps are optimizer steps, ``trainer.global_step`` of the batch):

* **explosion step**: first step ``t >= 1`` whose loss is non-finite, or exceeds 1.5x the lowest loss
  seen before ``t`` while the median of the next 10 losses exceeds 1.3x that lowest loss.
* **SpikeDetection step**: Lightning's ``SpikeDetection`` rule with its defaults (window 10, warmup 1,
  rtol 2.0, atol None, finite_only True) re-implemented on the logged loss series: a non-finite loss, or
  a loss that is not below the previous accepted one and is >= 3x the running mean of the last 10
  accepted losses.
* **grad-norm z-score step**: first step ``t >= 50`` (the monitor's warm-up) whose total gradient norm
  (before clipping) is more than ``z`` standard deviations above the mean of the previous 50 steps'
  norms; reported for ``z = 5`` (a common choice) and ``z = 8`` (the smallest integer without a false
  alarm on the healthy runs here).
* **loss-creep step** (a signal for DivergenceGuard to combine): first step ``t >= 50`` at which the
  EMA of the loss (decay 0.9) exceeds 1.1x its lowest value since step 50.
* **suite step**: the first of the SA monitor's alerts (any kind), the ``z = 8`` gradient-norm rule and
  the loss-creep rule.
* **guard_warning / guard_critical**: first warning / critical alert of a ``DivergenceGuard(action="warn",
  every_n_steps=<every>)`` attached to the same run (defaults otherwise: robust loss and
  gradient-norm spikes, loss creep, corroboration of its warnings by SA's warnings).
* **suite_first / suite_critical**: first warning-or-critical / first critical alert of any monitor in
  the run (SA and the guard together): what a user of the suite sees, and when a guard with
  ``action="stop"`` would stop.
* **lead**: explosion step minus alert step (positive: the alert came first).

Run: ``/work/venv/bin/python benchmarks/bench_spectral_divergence.py`` (``--quick``: fewer settings).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import lightning.pytorch as pl  # noqa: E402
from gpt import GPTConfig, GPTModule, make_loader  # noqa: E402

from lightning_monitor import DivergenceGuard, SpectralAlignmentMonitor  # noqa: E402
from lightning_monitor.alerts import AlertHub  # noqa: E402
from lightning_monitor.functional.spectral import sign_diversity, spectral_alignment, top_singular_subspace  # noqa: E402

warnings.filterwarnings("ignore")

#: The monitor's warm-up in the benchmark: the initial loss drop of this model (first ~50 steps)
#: reorganises a random init and is no baseline.
WARMUP = 50


# ----------------------------------------------------------------------------- settings
@dataclass
class Setting:
    name: str
    healthy: bool
    layernorm: bool = True
    lr: float = 3e-3
    lr_end: Optional[float] = None
    ramp_steps: int = 1000
    precision: str = "32-true"
    steps: int = 300
    seeds: tuple[int, ...] = (0, 1)
    note: str = ""


SETTINGS = [
    Setting("healthy LN lr 3e-3", True, lr=3e-3),
    Setting("healthy LN lr 1e-3", True, lr=1e-3),
    Setting("healthy noLN lr 1e-3", True, layernorm=False, lr=1e-3),
    Setting("healthy LN lr 3e-3 bf16", True, lr=3e-3, precision="bf16-mixed"),
    Setting("LN constant lr 1.0", False, lr=1.0, steps=60, seeds=(0,)),
    Setting("noLN constant lr 2e-2", False, layernorm=False, lr=2e-2, steps=150, seeds=(0,)),
    Setting("noLN ramp 1e-3->0.1", False, layernorm=False, lr=1e-3, lr_end=0.1, ramp_steps=400, steps=250),
    Setting("LN ramp 1e-3->1.0", False, lr=1e-3, lr_end=1.0, ramp_steps=400),
    Setting("LN ramp 1e-3->1.0 bf16", False, lr=1e-3, lr_end=1.0, ramp_steps=400, precision="bf16-mixed"),
]


# ----------------------------------------------------------------------------- recorder
class Recorder(pl.Callback):
    """Every step: loss, gradient norm and, per Linear (head excluded), SA statistics and variants."""

    def __init__(self, layers: dict[str, nn.Linear], max_rows: int = 256, stop_after_explosion: int = 30) -> None:
        self.layers = layers
        self.max_rows = max_rows
        self.stop_after = stop_after_explosion
        self.rows: list[dict[str, Any]] = []
        self._v: dict[str, Tensor] = {}
        self._x: dict[str, Tensor] = {}
        self._y: dict[str, Tensor] = {}
        self._dy: dict[str, Tensor] = {}
        self._handles: list[Any] = []
        self._before: dict[str, Tensor] = {}
        self._uv: dict[str, tuple[Tensor, Tensor]] = {}
        self._bad = 0
        self._gen = torch.Generator().manual_seed(123)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        n_tok = batch[0].numel()
        self._idx = torch.randperm(n_tok, generator=self._gen)[: self.max_rows]
        for name, mod in self.layers.items():
            self._handles.append(mod.register_forward_hook(self._fwd(name)))

    def _fwd(self, name: str):
        def hook(mod, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1])[self._idx].float()
            self._x[name] = x
            self._y[name] = out.detach().reshape(-1, out.shape[-1])[self._idx].float()
            if out.requires_grad:
                out.register_hook(lambda g: self._dy.__setitem__(name, g.detach().reshape(-1, g.shape[-1])[self._idx].float()))
        return hook

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        grads = [p.grad.detach().float().norm() for p in pl_module.parameters() if p.grad is not None]
        row: dict[str, Any] = {"step": trainer.global_step, "grad_norm": float(torch.stack(grads).norm()),
                               "lr": optimizer.param_groups[0]["lr"]}
        for name, mod in self.layers.items():
            w = mod.weight.detach().float()
            sigma, u, v, basis = top_singular_subspace(w, self._v.get(name))
            self._v[name] = basis
            a = spectral_alignment(self._x[name], v)
            b = mod.bias.detach().float() if mod.bias is not None else 0.0
            ao = spectral_alignment(self._y[name] - b, u)  # = sign of a (sanity), kept for the record
            ay = spectral_alignment(self._y[name], u)
            dy = self._dy.get(name)
            if dy is not None:
                ag = spectral_alignment(dy, u)
                terms = (dy @ u) * (self._x[name] @ v)
                coh = float(terms.sum().abs() / terms.abs().sum().clamp_min(1e-30))
                dg = float(sign_diversity(ag))
            else:
                coh, dg = float("nan"), float("nan")
            row[name] = {
                "D": float(sign_diversity(a)), "mean_abs": float(a.abs().nanmean()), "sigma": float(sigma),
                "D_out_nobias": float(sign_diversity(ao)), "D_out": float(sign_diversity(ay)), "D_grad": dg,
                "coherence": coh,
            }
            self._before[name] = w.clone()
            self._uv[name] = (u, v)
        self.rows.append(row)
        self._x.clear(), self._y.clear(), self._dy.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = float(loss.detach())
        if not self.rows or "loss" in self.rows[-1]:
            return
        self.rows[-1]["loss"] = loss
        for name, mod in self.layers.items():
            dw = mod.weight.detach().float() - self._before[name]
            u, v = self._uv[name]
            self.rows[-1][name]["update_align"] = float(u @ dw @ v / dw.norm().clamp_min(1e-30))
        losses = [r["loss"] for r in self.rows]
        low = min(losses[:-1]) if len(losses) > 1 else loss
        self._bad = self._bad + 1 if (not math.isfinite(loss) or loss > 2 * low) else 0
        if self._bad >= self.stop_after:
            trainer.should_stop = True


# ----------------------------------------------------------------------------- rules
def explosion_step(loss: list[float], steps: list[int]) -> Optional[int]:
    for i in range(1, len(loss)):
        if not math.isfinite(loss[i]):
            return steps[i]
        low = min(x for x in loss[:i] if math.isfinite(x))
        nxt = [x if math.isfinite(x) else float("inf") for x in loss[i : i + 10]]
        if loss[i] > 1.5 * low and statistics.median(nxt) > 1.3 * low:
            return steps[i]
    return None


def spike_detection_step(loss: list[float], steps: list[int], window: int = 10, warmup: int = 1,
                         rtol: float = 2.0) -> Optional[int]:
    """Lightning SpikeDetection's decision (defaults) replayed on the loss series."""
    accepted: list[float] = []
    last = 0.0
    for i, (s, x) in enumerate(zip(steps, loss)):
        if i >= warmup:
            if not math.isfinite(x):
                return s
            running = sum(accepted[-window:]) / len(accepted[-window:]) if accepted else float("nan")
            better = x - last <= 0.0
            if not better and abs(x - running) >= abs(rtol * running):
                return s
        if math.isfinite(x):
            accepted.append(x)
            last = x
    return None


def grad_z_step(gn: list[float], steps: list[int], window: int = 50, z: float = 5.0, start: int = 50) -> Optional[int]:
    for i in range(len(gn)):
        if steps[i] < start:
            continue
        if not math.isfinite(gn[i]):
            return steps[i]
        past = [g for g in gn[max(0, i - window) : i] if math.isfinite(g)]
        if len(past) < 10:
            continue
        mu, sd = statistics.fmean(past), statistics.pstdev(past)
        if gn[i] > mu + z * max(sd, 1e-12):
            return steps[i]
    return None


def loss_creep_step(loss: list[float], steps: list[int], rise: float = 1.1, start: int = 50,
                    decay: float = 0.9) -> Optional[int]:
    ema: Optional[float] = None
    low = float("inf")
    for s, x in zip(steps, loss):
        if not math.isfinite(x):
            return s
        ema = x if ema is None else decay * ema + (1 - decay) * x
        if s >= start:
            if ema > rise * low:
                return s
            low = min(low, ema)
    return None


def sa_replay(rows: list[dict], layers: list[str], stat: str, every: int, warmup: int,
              **kw: Any) -> dict[str, Optional[int]]:
    """The monitor's rules replayed offline on a recorded per-layer ``stat`` (a sign diversity) and
    sigma_1, at the monitor's cadence: first step of each (kind, severity)."""
    mon = SpectralAlignmentMonitor(every_n_steps=every, warmup_steps=warmup, **kw)
    first: dict[str, Optional[int]] = {}

    def condition(step, kind, active, severity, *a, **k):  # noqa: ANN001
        if active:
            first.setdefault(f"{kind}:{severity}", step)

    mon.condition = condition  # type: ignore[method-assign]
    for r in rows:
        if not mon.is_due(r["step"]):
            continue
        mon._update_rule(r["step"], {n: r[n][stat] for n in layers}, {n: r[n]["sigma"] for n in layers})
    return first


def update_align_step(rows: list[dict], layers: list[str], every: int, thr: float, k: int, start: int) -> Optional[int]:
    """First check where the median over layers of the update's alignment with u_1 v_1^T (in units
    of ||dW||_F) has exceeded ``thr`` for ``k`` consecutive checks."""
    streak = 0
    for r in rows:
        s = r["step"]
        if s % every or s < start:
            continue
        vals = [r[n].get("update_align", float("nan")) for n in layers]
        vals = [v for v in vals if math.isfinite(v)]
        med = statistics.median(vals) if vals else float("nan")
        streak = streak + 1 if (not math.isfinite(med) or med > thr) else 0
        if streak >= k:
            return s
    return None


# ----------------------------------------------------------------------------- runs
def run(setting: Setting, seed: int, every: int, steps_override: Optional[int] = None) -> dict[str, Any]:
    pl.seed_everything(seed, verbose=False)
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, block_size=64, layernorm=setting.layernorm)
    module = GPTModule(cfg, lr=setting.lr, lr_end=setting.lr_end, ramp_steps=setting.ramp_steps)
    monitor = SpectralAlignmentMonitor(every_n_steps=every, warmup_steps=WARMUP)
    # the suite as a user runs it: the guard (warn only, so the run goes on to its explosion) beside SA
    guard = DivergenceGuard(action="warn", every_n_steps=every)
    layers = monitor.select_layers(module)
    rec = Recorder(layers)
    steps = steps_override or setting.steps
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", precision=setting.precision, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp, callbacks=[rec, monitor, guard], num_sanity_val_steps=0,
        )
        t0 = time.perf_counter()
        trainer.fit(module, make_loader("prose", block_size=64, batch_size=16, seed=seed, n_samples=16 * steps))
        wall = time.perf_counter() - t0
        alerts = list(AlertHub.for_trainer(trainer).history)
    sa_alerts = [a for a in alerts if a.monitor == "sa" and not a.kind.endswith("_cleared")]
    guard_alerts = [a for a in alerts if a.monitor == "guard" and not a.kind.endswith("_cleared")]
    suite_alerts = [a for a in alerts if a.severity in ("warning", "critical") and not a.kind.endswith("_cleared")]

    def first(kind: Optional[str] = None, severity: Optional[str] = None) -> Optional[int]:
        return next((a.step for a in sa_alerts if (kind is None or a.kind == kind)
                     and (severity is None or a.severity == severity)), None)

    return {"setting": setting.name, "healthy": setting.healthy, "seed": seed, "rows": rec.rows,
            "layers": list(layers), "sa_first": first(), "sa_warning": first("collapse"),
            "sa_critical": first("collapse", "critical"), "sa_sigma": first("sigma_growth"), "wall_s": wall,
            "guard_warning": next((a.step for a in guard_alerts if a.severity == "warning"), None),
            "guard_critical": next((a.step for a in guard_alerts if a.severity == "critical"), None),
            "guard_critical_kind": next((a.kind for a in guard_alerts if a.severity == "critical"), None),
            "suite_first": next((a.step for a in suite_alerts), None),
            "suite_critical": next((a.step for a in suite_alerts if a.severity == "critical"), None)}


def analyse(res: dict[str, Any], every: int) -> dict[str, Any]:
    rows, layers = res["rows"], res["layers"]
    steps = [r["step"] for r in rows]
    loss = [r.get("loss", float("nan")) for r in rows]
    gn = [r["grad_norm"] for r in rows]
    out = {k: res[k] for k in ("setting", "healthy", "seed", "sa_first", "sa_warning", "sa_critical", "sa_sigma", "wall_s",
                               "guard_warning", "guard_critical", "guard_critical_kind", "suite_first",
                               "suite_critical")}
    out["steps_run"] = len(rows)
    out["explosion"] = explosion_step(loss, steps)
    out["spike_detection"] = spike_detection_step(loss, steps)
    out["grad_z"] = grad_z_step(gn, steps, z=5.0, start=WARMUP)
    out["grad_z8"] = grad_z_step(gn, steps, z=8.0, start=WARMUP)
    out["loss_creep"] = loss_creep_step(loss, steps, start=WARMUP)
    firsts = [x for x in (res["sa_first"], out["grad_z8"], out["loss_creep"]) if x is not None]
    out["suite"] = min(firsts) if firsts else None
    out["final_loss"] = loss[-1]
    # variants, replayed at the monitor's cadence with the monitor's default rule
    for stat in ("D_out", "D_grad"):
        f = sa_replay(rows, layers, stat, every, WARMUP, max_sigma_growth=None)
        out[f"collapse[{stat}]"] = f.get("collapse:warning")
    f = sa_replay(rows, layers, "D", every, WARMUP, max_sigma_growth=None)
    out["collapse_only"] = f.get("collapse:warning")
    out["update_align"] = update_align_step(rows, layers, every, thr=0.25, k=3, start=WARMUP + 10 * every)
    return out


def fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, tuple):
        return "/".join(fmt(v) for v in x)
    if isinstance(x, float):
        return f"{x:.2f}"
    return str(x)


def lead(explosion: Optional[int], alert: Optional[int]) -> str:
    if alert is None:
        return "none"
    if explosion is None:
        return f"FALSE ALARM @{alert}"
    return f"{explosion - alert:+d}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one healthy and two diverging settings, one seed")
    ap.add_argument("--every", type=int, default=5, help="monitor cadence (every_n_steps) [5]")
    ap.add_argument("--json", default=None, help="write the per-run summaries (and series) to this file")
    ap.add_argument("--only", default=None, help="run only settings whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(1)
    settings = SETTINGS
    if args.only:
        settings = [s for s in settings if args.only in s.name]
    if args.quick:
        settings = [SETTINGS[0], SETTINGS[6], SETTINGS[7]]
    results = []
    t0 = time.perf_counter()
    for st in settings:
        for seed in (st.seeds[:1] if args.quick else st.seeds):
            res = run(st, seed, args.every)
            a = analyse(res, args.every)
            a["series"] = {"loss": [r.get("loss") for r in res["rows"]], "grad_norm": [r["grad_norm"] for r in res["rows"]]}
            results.append((a, res))
            print(json.dumps({k: v for k, v in a.items() if k != "series"}), flush=True)
    print(f"\ntotal wall {time.perf_counter() - t0:.0f} s (monitor and recorder every step included)\n")
    cols = ["setting", "seed", "explosion", "sa_first", "sa_warning", "sa_critical", "sa_sigma", "spike_detection",
            "grad_z", "grad_z8", "loss_creep", "suite", "guard_warning", "guard_critical", "suite_first",
            "suite_critical", "collapse[D_out]", "collapse[D_grad]", "update_align"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for a, _ in results:
        cells = [a["setting"], str(a["seed"]), fmt(a["explosion"])]
        for c in cols[3:]:
            v = a[c]
            if c == "guard_critical" and v is not None:
                cells.append(f"{v} {a['guard_critical_kind']} ({lead(a['explosion'], v)})")
                continue
            if isinstance(v, tuple):
                cells.append(f"{fmt(v)} ({lead(a['explosion'], v[0])})")
            else:
                cells.append(f"{fmt(v)} ({lead(a['explosion'], v)})")
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{"summary": {k: v for k, v in a.items()}, "rows": r["rows"]} for a, r in results], fh)


if __name__ == "__main__":
    main()
