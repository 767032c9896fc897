"""Divergence zoo: is a divergence guard *specific*? It must act on runs that really diverge, and never
on healthy runs or on their matched controls.

Scenarios (``SCENARIOS``; models, data and LR schedules in ``benchmarks/zoo_models.py``), each a few
hundred optimizer steps on CPU, one torch thread. Families: ``gpt_ln`` (the example GPT, 2 layers,
d_model 32, block 32), ``gpt_noln`` (the same without LayerNorm), ``mlp`` (a 64-128-128-10 classifier
on sklearn's 8x8 digits) and ``cnn`` (a small CNN with BatchNorm on the same digits). fp32 and
``bf16-mixed``; SGD (momentum 0.9) and AdamW. Kinds:

* ``diverging``: LR ramps (linear, exponential) past the edge of stability, a sudden LR jump, a constant
  LR too high from the start, a huge LR in bf16, and injected bad batches (a NaN loss, a NaN / Inf /
  huge (noise x 1e3) input batch, a NaN batch through BatchNorm). Each has a **matched control** (``kind="control"``,
  named ``<name>_ctrl``): the same seed, data order and schedule, with the LR multiplier capped at its
  value of a step before the divergence (so the control is the diverging run up to that step), or, for
  an injection, without the injection, or, for a constant LR too high, at a sane LR.
* ``healthy``: warm-up + cosine, step decay, SGDR, curricula (easy data first), labels turned random
  mid-run (a data shift: a warning is acceptable, an action is not), batch sizes 1 and 2, near-zero
  losses, 20% flipped labels, a long plateau. They are the main false-alarm test.

Split (fixed below, in ``SCENARIOS``, checked at import): within each family and kind, the scenarios
alternate between ``tune`` and ``heldout``, so that both halves hold every family and both diverging and
healthy runs; a diverging run and its control are always in the same half. Calibrate a guard on ``tune``
only and report ``heldout``.

* tune (22 runs): diverging (each with its ``_ctrl``) gpt_ln_const_high, gpt_ln_nan_loss, gpt_noln_bf16_jump,
  mlp_sgd_jump, mlp_huge_input, cnn_sgd_exp_ramp, cnn_bf16_huge_lr; healthy gpt_ln_warmup_cosine,
  gpt_ln_batch2, gpt_noln_step_decay, mlp_label_noise, mlp_near_zero, mlp_plateau, cnn_warmup_cosine,
  cnn_curriculum.
* heldout (17 runs): diverging (each with its ``_ctrl``) gpt_ln_exp_ramp, gpt_noln_linear_ramp,
  mlp_sgd_linear_ramp, mlp_inf_input, cnn_nan_batch; healthy gpt_ln_curriculum, gpt_ln_bf16_cosine,
  gpt_noln_sgdr, mlp_random_labels, mlp_batch1, cnn_batch2, cnn_step_decay.

Objective explosion step, from the *unguarded* run's per-step losses: the trigger step is the injection
step for an injection, else the first step whose LR exceeds the control's LR (for a capped ramp or jump:
the step after the cap; for a constant LR too high: step 0). The pre-divergence level L0 is the median
loss over the 20 steps before the trigger (the initial loss when the trigger is step 0). The explosion
step is the first step at or after the trigger whose loss is non-finite or above 2 x L0 (for an
injection: the injection step itself, if its loss is so). A diverging run that never explodes is flagged
for recalibration, and so is a control (of a ramp, jump or high LR) whose loss crosses 2 x L0 after the
trigger, or any control whose unguarded loss ends above 1.2 x L0 (the median of its last 20 losses): such a
control degrades on its own, so an action on it cannot show that an alarm is specific. The summary counts
actions on the healthy runs and the calibrated controls, and those on uncalibrated controls apart.

Guards, on every scenario:

1. ours: ``lightning_monitor.DivergenceGuard(action="rollback", **--guard-kwargs)``, in its own run: its
   first warning and critical alerts, its first action (rollback or stop), its rollbacks, final loss and
   whether weights and buffers end finite;
2. Lightning's ``SpikeDetection`` (defaults), replayed offline on the unguarded loss trace;
3. a naive rule, offline on the unguarded gradient norms: fire when the norm is non-finite or, after 10
   steps, above 5 x the median of all previous finite norms.

An alarm's lead is explosion step - alarm step (>= 0: caught before the loss passed 2 x L0). A diverging
run "ends healthy" when its guarded run ends with finite weights and buffers and a final loss at most
1.1 x the unguarded control's. The final loss is the mean loss of the final weights, in eval mode, on the
16 batches that follow the run's data (the same batches for a run and its control), so it describes the
model the run ends with (a rollback on the last steps restores weights after their losses were recorded).

* fresh (21 runs, ``f_*``), unseen (21 runs, ``u_*``), novel (27 runs, ``n_*``) and blind (21 runs, ``b_*``):
  held-out sets fixed and calibrated before later changes of the rules, each looked at with the rules it was
  held out from (see BENCHMARKS.md). novel and blind add three families: ``hf_gpt2`` (Hugging Face's
  ``GPT2LMHeadModel`` from a tiny random-init config), ``lstm`` (a character LSTM language model) and ``reg``
  (an MLP regressor with a mean squared error loss on Friedman's function).

Run: python benchmarks/divergence_zoo.py [--split tune|heldout|fresh|unseen|novel|blind|all] [--only NAME_SUBSTRING] [--workers 2]
     [--json out.json] [--markdown] [--guard-kwargs '{"z_threshold": 8}'] [--no-guard] [--verify-spike]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, SpikeDetection
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_models import (  # noqa: E402
    SGDR, Capped, Const, Data, DigitsClassifier, Exp, Jump, Linear, WarmupCosine, ZooGPT, ZooHFGPT2, ZooLSTM,
    ZooRegressor, make_data)

# ----------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    """One run of the zoo. ``injection = (batch_index, kind)`` corrupts that batch (see ``ZooMixin``)."""

    name: str
    family: str  # "gpt_ln" | "gpt_noln" | "mlp" | "cnn" | "hf_gpt2" | "lstm" | "reg"
    kind: str  # "diverging" | "control" | "healthy"
    split: str  # "tune" | "heldout" | "fresh" | "unseen" | "novel" | "blind"
    optimizer: str
    lr: float
    data: Data
    lr_mult: Callable[[int], float] = field(default_factory=Const)
    steps: int = 200
    seed: int = 0
    precision: str = "32-true"
    injection: Optional[tuple[int, str]] = None
    pairs: Optional[str] = None  # the matched control of a diverging run, and the other way round


def _pair(diverging: Scenario, **control: Any) -> list[Scenario]:
    """A diverging scenario and its matched control (``control``: the fields that differ)."""
    ctrl = replace(diverging, name=f"{diverging.name}_ctrl", kind="control", pairs=diverging.name, **control)
    return [replace(diverging, pairs=ctrl.name), ctrl]


def _div(name: str, family: str, split: str, optimizer: str, lr: float, data: Data, **kw: Any) -> Scenario:
    return Scenario(name, family, "diverging", split, optimizer, lr, data, **kw)


def _ok(name: str, family: str, split: str, optimizer: str, lr: float, data: Data, **kw: Any) -> Scenario:
    return Scenario(name, family, "healthy", split, optimizer, lr, data, **kw)


TEXT, DIGITS, FRIEDMAN = Data("prose"), Data("digits", batch=32), Data("friedman", batch=32)
_GPT_EXP, _GPT_LIN, _MLP_LIN, _CNN_EXP = Exp(10.0, 100), Linear(100.0, 300), Linear(50.0, 250), Exp(10.0, 20, 25)

# Calibrated by running them (``--no-guard``): every diverging run explodes and no control of a ramp, jump or
# high LR crosses 2 x L0. Per-step losses of the digits models are heavy-tailed (a batch of 32 at loss 0.05 can
# read 0.15), so their LR triggers sit early (L0 >= 0.28) and their controls stay at a calm LR.
SCENARIOS: list[Scenario] = [
    # -- diverging, each with its matched control
    # lr 0.1 (and 0.3) do not blow this small GPT up (peak 1.7 x L0); 0.5 does by step 2
    *_pair(_div("gpt_ln_const_high", "gpt_ln", "tune", "adamw", 0.5, TEXT), lr=3e-3),
    *_pair(_div("gpt_ln_exp_ramp", "gpt_ln", "heldout", "adamw", 1e-3, TEXT, lr_mult=_GPT_EXP, steps=300),
           lr_mult=Capped(_GPT_EXP, 150)),
    *_pair(_div("gpt_ln_nan_loss", "gpt_ln", "tune", "adamw", 3e-3, TEXT, injection=(100, "nan_loss")),
           injection=None),
    *_pair(_div("gpt_noln_linear_ramp", "gpt_noln", "heldout", "adamw", 1e-3, TEXT, lr_mult=_GPT_LIN, steps=300),
           lr_mult=Capped(_GPT_LIN, 100)),
    *_pair(_div("gpt_noln_bf16_jump", "gpt_noln", "tune", "adamw", 3e-3, TEXT, lr_mult=Jump(100, 30.0),
                precision="bf16-mixed"), lr_mult=Capped(Jump(100, 30.0), 99)),
    *_pair(_div("mlp_sgd_jump", "mlp", "tune", "sgd", 0.05, DIGITS, lr_mult=Jump(60, 40.0)),
           lr_mult=Capped(Jump(60, 40.0), 59)),
    # AdamW ramps on the digits MLP make it spiky rather than explode: its ramp is SGD
    *_pair(_div("mlp_sgd_linear_ramp", "mlp", "heldout", "sgd", 0.02, DIGITS, lr_mult=_MLP_LIN, steps=250),
           lr_mult=Capped(_MLP_LIN, 35)),
    *_pair(_div("mlp_huge_input", "mlp", "tune", "sgd", 0.05, DIGITS, injection=(100, "huge_input")),
           injection=None),
    *_pair(_div("mlp_inf_input", "mlp", "heldout", "adamw", 1e-3, DIGITS, injection=(120, "inf_input")),
           injection=None),
    *_pair(_div("cnn_sgd_exp_ramp", "cnn", "tune", "sgd", 0.05, DIGITS, lr_mult=_CNN_EXP),
           lr_mult=Capped(_CNN_EXP, 25)),
    *_pair(_div("cnn_nan_batch", "cnn", "heldout", "sgd", 0.05, DIGITS, injection=(100, "nan_input")),
           injection=None),
    *_pair(_div("cnn_bf16_huge_lr", "cnn", "tune", "sgd", 0.05, DIGITS, lr_mult=Jump(30, 100.0),
                precision="bf16-mixed"), lr_mult=Capped(Jump(30, 100.0), 29)),
    # -- healthy
    _ok("gpt_ln_warmup_cosine", "gpt_ln", "tune", "adamw", 3e-3, TEXT, lr_mult=WarmupCosine(20, 250), steps=250),
    _ok("gpt_ln_curriculum", "gpt_ln", "heldout", "adamw", 3e-3, Data("prose", curriculum=100), steps=250),
    _ok("gpt_ln_batch2", "gpt_ln", "tune", "adamw", 1e-3, Data("prose", batch=2), steps=250),
    _ok("gpt_ln_bf16_cosine", "gpt_ln", "heldout", "adamw", 3e-3, TEXT, lr_mult=WarmupCosine(20, 250), steps=250,
        precision="bf16-mixed"),
    _ok("gpt_noln_step_decay", "gpt_noln", "tune", "adamw", 2e-3, TEXT, lr_mult=Jump(150, 0.1), steps=250),
    _ok("gpt_noln_sgdr", "gpt_noln", "heldout", "adamw", 2e-3, TEXT, lr_mult=SGDR(40), steps=280),
    _ok("mlp_label_noise", "mlp", "tune", "sgd", 0.05, Data("digits", label_noise=0.2), steps=300),
    _ok("mlp_random_labels", "mlp", "heldout", "sgd", 0.05, Data("digits", random_labels_at=150), steps=300),
    _ok("mlp_near_zero", "mlp", "tune", "adamw", 3e-3, Data("digits", batch=64), steps=300),
    _ok("mlp_batch1", "mlp", "heldout", "sgd", 0.01, Data("digits", batch=1), steps=300),
    _ok("mlp_plateau", "mlp", "tune", "sgd", 3e-4, DIGITS, steps=300),
    _ok("cnn_warmup_cosine", "cnn", "tune", "sgd", 0.05, DIGITS, lr_mult=WarmupCosine(20, 250), steps=250),
    _ok("cnn_batch2", "cnn", "heldout", "sgd", 0.01, Data("digits", batch=2), steps=300),
    _ok("cnn_curriculum", "cnn", "tune", "sgd", 0.05, Data("digits", curriculum=100), steps=250),
    _ok("cnn_step_decay", "cnn", "heldout", "adamw", 3e-3, DIGITS, lr_mult=Jump(120, 0.1), steps=250),
    # -- fresh: a second held-out half, fixed before the rules were changed again (the first held-out half had
    # been looked at three times). Other seeds, longer runs, slower ramps; calibrated with --no-guard only.
    *_pair(_div("f_gpt_ln_slow_ramp", "gpt_ln", "fresh", "adamw", 1e-3, TEXT, lr_mult=Linear(1000.0, 400), steps=450,
                seed=1), lr_mult=Capped(Linear(1000.0, 400), 120)),
    *_pair(_div("f_gpt_noln_exp_ramp", "gpt_noln", "fresh", "adamw", 1e-3, TEXT, lr_mult=Exp(10.0, 150), steps=400,
                seed=2), lr_mult=Capped(Exp(10.0, 150), 150)),
    *_pair(_div("f_gpt_ln_bf16_jump", "gpt_ln", "fresh", "adamw", 3e-3, TEXT, lr_mult=Jump(150, 200.0), steps=300,
                seed=3, precision="bf16-mixed"), lr_mult=Capped(Jump(150, 200.0), 149)),
    *_pair(_div("f_mlp_adamw_jump", "mlp", "fresh", "adamw", 1e-3, DIGITS, lr_mult=Jump(100, 300.0), steps=250,
                seed=1), lr_mult=Capped(Jump(100, 300.0), 99)),
    *_pair(_div("f_cnn_sgd_linear_ramp", "cnn", "fresh", "sgd", 0.02, DIGITS, lr_mult=Linear(60.0, 200), steps=300,
                seed=1), lr_mult=Capped(Linear(60.0, 200), 30)),
    *_pair(_div("f_mlp_nan_loss", "mlp", "fresh", "sgd", 0.05, DIGITS, injection=(150, "nan_loss"), steps=250,
                seed=2), injection=None),
    *_pair(_div("f_cnn_huge_input", "cnn", "fresh", "adamw", 1e-3, DIGITS, injection=(130, "huge_input"), steps=250,
                seed=2), injection=None),
    _ok("f_gpt_ln_warmup_cosine_long", "gpt_ln", "fresh", "adamw", 3e-3, TEXT, lr_mult=WarmupCosine(40, 400, 0.1),
        steps=400, seed=1),
    _ok("f_gpt_noln_batch1", "gpt_noln", "fresh", "adamw", 1e-3, Data("prose", batch=1), steps=300, seed=2),
    _ok("f_gpt_ln_curriculum_long", "gpt_ln", "fresh", "adamw", 2e-3, Data("prose", curriculum=150), steps=350,
        seed=3),
    _ok("f_mlp_sgdr", "mlp", "fresh", "sgd", 0.05, DIGITS, lr_mult=SGDR(30), steps=300, seed=1),
    _ok("f_mlp_label_noise40", "mlp", "fresh", "adamw", 1e-3, Data("digits", label_noise=0.4), steps=300, seed=2),
    _ok("f_cnn_random_labels", "cnn", "fresh", "sgd", 0.05, Data("digits", random_labels_at=120), steps=250, seed=1),
    _ok("f_cnn_batch1", "cnn", "fresh", "adamw", 1e-3, Data("digits", batch=1), steps=300, seed=3),
    # -- unseen: a third held-out set, fixed and calibrated (--no-guard) before the rules changed after the fresh
    # set had been looked at; other seeds and settings again (a linear GPT ramp, an SGD exponential ramp on the
    # MLP, an AdamW jump on the CNN, a bf16 jump on the MLP, an Inf batch through BatchNorm ...)
    *_pair(_div("u_gpt_ln_linear_ramp", "gpt_ln", "unseen", "adamw", 1e-3, TEXT, lr_mult=Linear(800.0, 250),
                steps=350, seed=4), lr_mult=Capped(Linear(800.0, 250), 60)),
    *_pair(_div("u_gpt_noln_jump", "gpt_noln", "unseen", "adamw", 2e-3, TEXT, lr_mult=Jump(120, 50.0), steps=250,
                seed=5), lr_mult=Capped(Jump(120, 50.0), 119)),
    *_pair(_div("u_gpt_ln_nan_loss", "gpt_ln", "unseen", "adamw", 3e-3, TEXT, injection=(180, "nan_loss"), steps=250,
                seed=6), injection=None),
    *_pair(_div("u_mlp_sgd_exp_ramp", "mlp", "unseen", "sgd", 0.02, DIGITS, lr_mult=Exp(10.0, 40, 50), steps=250,
                seed=4), lr_mult=Capped(Exp(10.0, 40, 50), 60)),
    *_pair(_div("u_mlp_bf16_jump", "mlp", "unseen", "sgd", 0.05, DIGITS, lr_mult=Jump(80, 100.0), steps=220, seed=6,
                precision="bf16-mixed"), lr_mult=Capped(Jump(80, 100.0), 79)),
    *_pair(_div("u_cnn_adamw_jump", "cnn", "unseen", "adamw", 1e-3, DIGITS, lr_mult=Jump(90, 300.0), steps=220,
                seed=4), lr_mult=Capped(Jump(90, 300.0), 89)),
    *_pair(_div("u_cnn_inf_input", "cnn", "unseen", "sgd", 0.05, DIGITS, injection=(110, "inf_input"), steps=220,
                seed=5), injection=None),
    _ok("u_gpt_noln_warmup_cosine", "gpt_noln", "unseen", "adamw", 2e-3, TEXT, lr_mult=WarmupCosine(30, 300),
        steps=300, seed=4),
    _ok("u_gpt_ln_step_decay", "gpt_ln", "unseen", "adamw", 3e-3, TEXT, lr_mult=Jump(120, 0.3), steps=250, seed=5),
    _ok("u_mlp_curriculum", "mlp", "unseen", "sgd", 0.05, Data("digits", curriculum=120), steps=280, seed=4),
    _ok("u_mlp_batch2", "mlp", "unseen", "adamw", 1e-3, Data("digits", batch=2), steps=300, seed=5),
    _ok("u_mlp_random_labels", "mlp", "unseen", "adamw", 1e-3, Data("digits", random_labels_at=140), steps=280,
        seed=7),
    _ok("u_cnn_label_noise20", "cnn", "unseen", "sgd", 0.05, Data("digits", label_noise=0.2), steps=250, seed=6),
    _ok("u_cnn_sgdr", "cnn", "unseen", "sgd", 0.05, DIGITS, lr_mult=SGDR(40), steps=280, seed=4),
    # -- novel: a fourth held-out set with three model families no rule was made on (Hugging Face's GPT2LMHeadModel,
    # a character LSTM, an MSE regressor), seeds 8-11, fixed and calibrated (--no-guard) before any guarded run
    *_pair(_div("n_hf_gpt2_exp_ramp", "hf_gpt2", "novel", "adamw", 1e-3, TEXT, lr_mult=Exp(10.0, 100), steps=350,
                seed=8), lr_mult=Capped(Exp(10.0, 100), 120)),
    *_pair(_div("n_hf_gpt2_nan_loss", "hf_gpt2", "novel", "adamw", 2e-3, TEXT, injection=(150, "nan_loss"), steps=250,
                seed=9), injection=None),
    *_pair(_div("n_hf_gpt2_const_high", "hf_gpt2", "novel", "adamw", 1.0, TEXT, steps=200, seed=10), lr=2e-3),
    *_pair(_div("n_lstm_sgd_jump", "lstm", "novel", "sgd", 0.5, TEXT, lr_mult=Jump(100, 40.0), steps=250, seed=8),
           lr_mult=Capped(Jump(100, 40.0), 99)),
    *_pair(_div("n_lstm_adamw_linear_ramp", "lstm", "novel", "adamw", 2e-3, TEXT, lr_mult=Linear(500.0, 250),
                steps=350, seed=9), lr_mult=Capped(Linear(500.0, 250), 50)),
    *_pair(_div("n_reg_sgd_exp_ramp", "reg", "novel", "sgd", 0.01, FRIEDMAN, lr_mult=Exp(10.0, 40, 40), steps=250,
                seed=8), lr_mult=Capped(Exp(10.0, 40, 40), 60)),
    *_pair(_div("n_reg_huge_input", "reg", "novel", "sgd", 0.01, FRIEDMAN, injection=(120, "huge_input"), steps=250,
                seed=10), injection=None),
    *_pair(_div("n_gpt_ln_bf16_exp_ramp", "gpt_ln", "novel", "adamw", 1e-3, TEXT, lr_mult=Exp(10.0, 100), steps=350,
                seed=11, precision="bf16-mixed"), lr_mult=Capped(Exp(10.0, 100), 120)),
    *_pair(_div("n_mlp_adamw_const_high", "mlp", "novel", "adamw", 0.3, DIGITS, steps=200, seed=9), lr=1e-3),
    _ok("n_hf_gpt2_warmup_cosine", "hf_gpt2", "novel", "adamw", 3e-3, TEXT, lr_mult=WarmupCosine(30, 300), steps=300,
        seed=8),
    _ok("n_hf_gpt2_batch2", "hf_gpt2", "novel", "adamw", 1e-3, Data("prose", batch=2), steps=300, seed=9),
    _ok("n_lstm_step_decay", "lstm", "novel", "adamw", 5e-3, TEXT, lr_mult=Jump(150, 0.2), steps=300, seed=10),
    _ok("n_lstm_curriculum", "lstm", "novel", "adamw", 3e-3, Data("prose", curriculum=120), steps=300, seed=8),
    _ok("n_reg_near_zero", "reg", "novel", "adamw", 3e-3, Data("friedman", batch=32, target_noise=0.0), steps=400,
        seed=9),
    _ok("n_reg_sgdr", "reg", "novel", "sgd", 0.01, FRIEDMAN, lr_mult=SGDR(40), steps=300, seed=11),
    _ok("n_cnn_bf16_warmup_cosine", "cnn", "novel", "adamw", 2e-3, DIGITS, lr_mult=WarmupCosine(20, 250), steps=250,
        seed=9, precision="bf16-mixed"),
    _ok("n_mlp_label_noise20_adamw", "mlp", "novel", "adamw", 1e-3, Data("digits", batch=32, label_noise=0.2),
        steps=300, seed=10),
    _ok("n_gpt_noln_bf16_cosine", "gpt_noln", "novel", "adamw", 2e-3, TEXT, lr_mult=WarmupCosine(20, 300), steps=300,
        seed=10, precision="bf16-mixed"),
    # -- blind: a fifth held-out set, seeds 12-15, fixed and calibrated (--no-guard) after the rules changed on
    # the novel set and before any guarded run of its own
    *_pair(_div("b_hf_gpt2_linear_ramp", "hf_gpt2", "blind", "adamw", 1e-3, TEXT, lr_mult=Linear(600.0, 300),
                steps=400, seed=12), lr_mult=Capped(Linear(600.0, 300), 80)),
    *_pair(_div("b_hf_gpt2_bf16_jump", "hf_gpt2", "blind", "adamw", 2e-3, TEXT, lr_mult=Jump(130, 100.0), steps=260,
                seed=13, precision="bf16-mixed"), lr_mult=Capped(Jump(130, 100.0), 129)),
    *_pair(_div("b_lstm_const_high", "lstm", "blind", "adamw", 0.5, TEXT, steps=200, seed=12), lr=3e-3),
    *_pair(_div("b_lstm_nan_loss", "lstm", "blind", "adamw", 3e-3, TEXT, injection=(150, "nan_loss"), steps=250,
                seed=14), injection=None),
    *_pair(_div("b_reg_adamw_jump", "reg", "blind", "adamw", 1e-3, Data("friedman", batch=128),
                lr_mult=Jump(100, 500.0), steps=250, seed=13), lr_mult=Capped(Jump(100, 500.0), 99)),
    *_pair(_div("b_gpt_noln_sgd_exp_ramp", "gpt_noln", "blind", "sgd", 0.05, TEXT, lr_mult=Exp(10.0, 60, 40),
                steps=300, seed=15), lr_mult=Capped(Exp(10.0, 60, 40), 50)),
    *_pair(_div("b_mlp_sgd_const_high", "mlp", "blind", "sgd", 3.0, DIGITS, steps=200, seed=14), lr=0.05),
    _ok("b_hf_gpt2_step_decay", "hf_gpt2", "blind", "adamw", 3e-3, TEXT, lr_mult=Jump(150, 0.3), steps=300, seed=14),
    _ok("b_hf_gpt2_curriculum", "hf_gpt2", "blind", "adamw", 2e-3, Data("prose", curriculum=130), steps=300, seed=15),
    _ok("b_lstm_sgdr", "lstm", "blind", "adamw", 3e-3, TEXT, lr_mult=SGDR(50), steps=350, seed=12),
    _ok("b_reg_batch4", "reg", "blind", "adamw", 1e-3, Data("friedman", batch=4), steps=300, seed=15),
    _ok("b_reg_noisy_targets", "reg", "blind", "sgd", 0.01, Data("friedman", batch=32, target_noise=1.0), steps=300,
        seed=12),
    _ok("b_cnn_curriculum_adamw", "cnn", "blind", "adamw", 1e-3, Data("digits", batch=32, curriculum=100), steps=250,
        seed=13),
    _ok("b_mlp_bf16_warmup_cosine", "mlp", "blind", "sgd", 0.1, DIGITS, lr_mult=WarmupCosine(20, 250), steps=250,
        seed=14, precision="bf16-mixed"),
]
BY_NAME = {s.name: s for s in SCENARIOS}
SPLITS = ("tune", "heldout", "fresh", "unseen", "novel", "blind")


def _check_split() -> None:
    """The first four sets hold each of the four first families with diverging and healthy runs, ``novel`` holds
    its three new families so; a run and its pair share a set."""
    for s in SCENARIOS:
        assert s.split in SPLITS and s.kind in ("diverging", "control", "healthy"), s.name
        assert s.pairs is None or BY_NAME[s.pairs].split == s.split, s.name
    for split in SPLITS:
        families = ("hf_gpt2", "lstm", "reg") if split in ("novel", "blind") else ("gpt_ln", "gpt_noln", "mlp", "cnn")
        for fam in families:
            for kind in ("diverging", "healthy"):
                found = any(s.split == split and s.family == fam and s.kind == kind for s in SCENARIOS)
                assert found, (split, fam, kind)


_check_split()

# ----------------------------------------------------------------------------- runner


class Recorder(Callback):
    """Per step: the step, the batch index, the loss, the LR and the global gradient norm (fp32).

    Placed after the guard, so that it records the step and LR the guard leaves (after a rollback) and the
    gradients the guard leaves; in the unguarded run it sees everything as it is.
    """

    def __init__(self) -> None:
        self.trace: dict[str, list[float]] = {"step": [], "batch": [], "loss": [], "lr": [], "gnorm": []}
        self._step, self._lr, self._gnorm = 0, math.nan, math.nan

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step, self._gnorm = trainer.global_step, math.nan
        self._lr = float(trainer.optimizers[0].param_groups[0]["lr"])

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        norms = [torch.linalg.vector_norm(p.grad.float()) for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        self._gnorm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, Tensor):
            return
        for key, value in (("step", self._step), ("batch", batch_idx), ("loss", float(loss.detach().float())),
                           ("lr", self._lr), ("gnorm", self._gnorm)):
            self.trace[key].append(value)


def build_model(s: Scenario) -> pl.LightningModule:
    other = {"hf_gpt2": ZooHFGPT2, "lstm": ZooLSTM, "reg": ZooRegressor}
    if s.family in other:
        return other[s.family](s.optimizer, s.lr, s.lr_mult, s.injection)
    if s.family.startswith("gpt"):
        return ZooGPT(s.family == "gpt_ln", s.optimizer, s.lr, s.lr_mult, s.injection)
    return DigitsClassifier(s.family, s.optimizer, s.lr, s.lr_mult, s.injection)


def final_loss(losses: list[float], n: int = 10) -> float:
    """Mean of the last ``n`` finite step losses (nan if none)."""
    finite = [x for x in losses if math.isfinite(x)][-n:]
    return sum(finite) / len(finite) if finite else math.nan


@torch.no_grad()
def eval_loss(model: pl.LightningModule, loader: Any, steps: int, n: int = 16) -> float:
    """Mean loss of the final weights (eval mode) on the ``n`` batches that follow the run's data: what a
    run ends with, whatever happened on its last steps (a rollback restores weights after they were used)."""
    model.eval()
    losses = []
    for idx, batch in enumerate(loader):
        if idx >= steps + n:
            break
        if idx >= steps:
            losses.append(float(model.training_step(batch, idx).float()))
    return sum(losses) / len(losses) if losses else math.nan


def run(scenario: Scenario, callbacks_factory: Callable[[], list[Callback]]) -> dict[str, Any]:
    """Train ``scenario`` once with ``callbacks_factory()`` (plus a :class:`Recorder`) on a fresh Trainer."""
    pl.seed_everything(scenario.seed, verbose=False)
    model = build_model(scenario)
    loader = make_data(scenario.data, scenario.steps, scenario.seed)
    recorder = Recorder()
    error = None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(max_steps=scenario.steps, max_epochs=1, accelerator="cpu", precision=scenario.precision,
                             logger=False, callbacks=callbacks_factory() + [recorder], enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, default_root_dir=root)
        try:
            trainer.fit(model, loader)
        except Exception as err:  # a guard failing, SpikeDetection's TrainingSpikeException
            error = f"{type(err).__name__}: {err}"
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    return {
        "trace": recorder.trace,
        "final_loss": eval_loss(model, loader, scenario.steps),
        "final_train_loss": final_loss(recorder.trace["loss"]),
        "finite": all(bool(torch.isfinite(t).all()) for t in tensors),
        "error": error,
        "global_step": trainer.global_step,
        "seconds": time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------- offline rules


def spike_detection_step(losses: list[float], batches: list[int], window: int = 10, warmup: int = 1,
                         rtol: float = 2.0) -> Optional[int]:
    """Index of the first step Lightning's ``SpikeDetection()`` (defaults) raises at, replayed exactly.

    Its rule (``lightning/fabric/utilities/spike.py``, ``mode="min"``, ``atol=None``, ``finite_only=True``):
    from batch index ``warmup`` on, a non-finite loss is a spike, and so is a loss above the previous one
    and at least ``(1 + rtol)`` x the running mean of the last ``window`` non-spike losses. Checked with
    ``--verify-spike`` against the real callback: same step on every scenario of the zoo, fp32 and bf16.
    """
    history: list[float] = []
    last = 0.0
    for i, (loss, batch) in enumerate(zip(losses, batches)):
        if batch >= warmup:
            if not math.isfinite(loss):
                return i
            mean = statistics.fmean(history[-window:])
            if loss - last > 0 and abs(loss - mean) >= abs(rtol * mean):
                return i
        history.append(loss)
        last = loss
    return None


def naive_gnorm_step(gnorms: list[float], warmup: int = 10, factor: float = 5.0) -> Optional[int]:
    """First step whose gradient norm is non-finite, or (after ``warmup`` finite ones) above ``factor`` x the
    median of all previous finite norms."""
    seen: list[float] = []
    for i, g in enumerate(gnorms):
        if not math.isfinite(g) or (len(seen) >= warmup and g > factor * statistics.median(seen)):
            return i
        seen.append(g)
    return None


def trigger_step(div: Scenario, ctrl: Scenario) -> int:
    """Where the diverging run leaves its control: the injection, or the first step with a higher LR."""
    if div.injection is not None:
        return div.injection[0]
    return next((s for s in range(div.steps) if div.lr * div.lr_mult(s) > ctrl.lr * ctrl.lr_mult(s) * (1 + 1e-9)),
                div.steps)


def explosion(losses: list[float], trigger: int, injected: bool) -> tuple[float, Optional[int], float]:
    """(L0, explosion step or None, peak loss / L0 from the trigger on; inf when non-finite)."""
    before = losses[max(0, trigger - 20):trigger] or losses[:1]
    level = statistics.median(before)
    after = losses[trigger:]
    peak = max((x if math.isfinite(x) else math.inf for x in after), default=math.nan) / level
    if injected:
        bad = not math.isfinite(losses[trigger]) or losses[trigger] > 2 * level
        return level, trigger if bad else None, peak
    step = next((trigger + i for i, x in enumerate(after) if not math.isfinite(x) or x > 2 * level), None)
    return level, step, peak


# ----------------------------------------------------------------------------- workers


def _quiet() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("lightning_monitor").setLevel(logging.CRITICAL + 1)  # the alerts are read from the hub


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def _guarded(scenario: Scenario, guard_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The scenario under ``DivergenceGuard(action="rollback", **guard_kwargs)``, with what the guard did."""
    try:
        from lightning_monitor import DivergenceGuard

        guard = DivergenceGuard(**{"action": "rollback", **guard_kwargs})
    except (TypeError, ValueError) as err:
        return {"guard_error": f"guard API mismatch: {err}"}
    except Exception as err:  # the guard module is mid-rewrite
        return {"guard_error": f"guard unavailable: {type(err).__name__}: {err}"}
    out = run(scenario, lambda: [guard])
    try:
        history = guard.hub.history
    except Exception:  # no hub: the guard failed before setup
        history = []
    out["alerts"] = [a.to_dict() for a in history]
    out["rollbacks"] = _jsonable(list(getattr(guard, "rollbacks", [])))
    out["stopped_step"] = getattr(guard, "stopped_step", None)
    return out


def _spike_callback_step(scenario: Scenario) -> Optional[int]:
    """The step the real ``SpikeDetection()`` raises at (None if it never does)."""
    with tempfile.TemporaryDirectory() as root:
        out = run(scenario, lambda: [SpikeDetection(exclude_batches_path=os.path.join(root, "skip.json"))])
    # "Training spike detected in batch N": one epoch and no rollback, so batch N is step N
    found = re.search(r"spike detected in batch (\d+)", out["error"] or "")
    return int(found.group(1)) if found else None


def _task(args: tuple[str, str, dict[str, Any]]) -> tuple[str, str, dict[str, Any]]:
    name, mode, guard_kwargs = args
    scenario = BY_NAME[name]
    if mode == "plain":
        return name, mode, run(scenario, list)
    if mode == "guard":
        return name, mode, _guarded(scenario, guard_kwargs)
    return name, mode, {"step": _spike_callback_step(scenario)}


# ----------------------------------------------------------------------------- metrics


def _first(steps: list[int]) -> Optional[int]:
    return min(steps) if steps else None


#: a matched control fails calibration when the median of its last CONTROL_TAIL unguarded losses is above
#: CONTROL_END_LIMIT x L0 (the diverging run's loss level before the trigger)
CONTROL_TAIL = 20
CONTROL_END_LIMIT = 1.2


def _uncalibrated_controls(rows: list[dict[str, Any]]) -> set[str]:
    """The controls whose diverging pair's calibration found the control itself unhealthy."""
    return {BY_NAME[r["name"]].pairs for r in rows if r["kind"] == "diverging" and r["issue"].startswith("control")}


def evaluate(s: Scenario, res: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One row: the explosion step, each guard's first alarm and what our guard did."""
    plain = res[s.name]["plain"]
    losses, gnorms = plain["trace"]["loss"], plain["trace"]["gnorm"]
    row: dict[str, Any] = {"name": s.name, "family": s.family, "kind": s.kind, "split": s.split,
                           "precision": s.precision, "optimizer": s.optimizer, "plain_final": plain["final_loss"],
                           "plain_finite": plain["finite"], "plain_error": plain["error"],
                           "spike": spike_detection_step(losses, plain["trace"]["batch"]),
                           "naive": naive_gnorm_step(gnorms), "explosion": None, "issue": ""}
    if "spike_check" in res[s.name]:
        row["spike_callback"] = res[s.name]["spike_check"]["step"]
    if s.kind == "diverging":
        ctrl = BY_NAME[s.pairs]
        ctrl_losses = res[ctrl.name]["plain"]["trace"]["loss"]
        trig = trigger_step(s, ctrl)
        level, step, peak = explosion(losses, trig, s.injection is not None)
        _, ctrl_step, ctrl_peak = explosion(ctrl_losses, trig, False)
        row.update(trigger=trig, l0=level, explosion=step, peak=peak, ctrl_peak=ctrl_peak,
                   ctrl_final=res[ctrl.name]["plain"]["final_loss"],
                   nonfinite_injection=s.injection is not None
                   and not (math.isfinite(losses[trig]) and math.isfinite(gnorms[trig])))
        if step is None:
            row["issue"] = "never explodes: recalibrate"
        elif s.injection is None and ctrl_step is not None:
            row["issue"] = f"control crosses 2 x L0 at step {ctrl_step}: recalibrate"
        # a control must stay healthy on its own: one whose loss ends well above the level it had before the
        # trigger degrades without the guard, so an action on it cannot show that an alarm is specific
        tail = [x for x in ctrl_losses[-CONTROL_TAIL:] if math.isfinite(x)]
        row["ctrl_end"] = statistics.median(tail) / level if tail else math.inf
        if not row["issue"] and row["ctrl_end"] > CONTROL_END_LIMIT:
            row["issue"] = (f"control ends at {row['ctrl_end']:.2f} x L0 without a guard (its own loss degrades): "
                            "recalibrate")
    guard = res[s.name].get("guard")
    if guard is None:
        return row
    if "guard_error" in guard:
        row["guard_error"] = guard["guard_error"]
        return row
    alerts = [a for a in guard["alerts"] if not a["kind"].endswith("_cleared")]
    actions = [r["step"] for r in guard["rollbacks"]] + ([guard["stopped_step"]] if guard["stopped_step"] is not None
                                                         else [])
    kinds: dict[str, int] = {}
    for a in alerts:
        if a["severity"] != "info":
            kinds[a["kind"]] = min(kinds.get(a["kind"], a["step"]), a["step"])
    row.update(
        guard_error=guard["error"],
        first_warning=_first([a["step"] for a in alerts if a["severity"] == "warning"]),
        first_critical=_first([a["step"] for a in alerts if a["severity"] == "critical"]),
        n_warnings=sum(a["severity"] == "warning" for a in alerts),
        action=_first(actions), rollbacks=len(guard["rollbacks"]), stopped=guard["stopped_step"] is not None,
        final=guard["final_loss"], finite=guard["finite"], kinds=kinds,
        nonfinite_on_step=s.injection is not None and any(
            a["kind"].startswith("nonfinite") and a["step"] == s.injection[0] for a in alerts),
    )
    if s.kind == "diverging":
        row["ends_healthy"] = bool(guard["finite"] and guard["final_loss"] <= 1.1 * row["ctrl_final"])
        stops = [a.get("details") or {} for a in guard["alerts"] if a["kind"] == "stopped"]
        to_step = guard["rollbacks"][0]["to_step"] if guard["rollbacks"] else (stops[0].get("to_step") if stops else None)
        # the state the first action went back to (a rollback's snapshot, or what a stop saved) predates the
        # explosion, and the weights end finite: nothing of the blow-up was kept. A snapshot of step t holds the state
        # before t's update: for a non-finite batch injected at the explosion step, the state of that step predates it
        # (its loss is the batch's fault); for weights that diverged, the explosion step's own state is already theirs
        before = (to_step <= row["explosion"] if row.get("nonfinite_injection") else to_step < row["explosion"]
                  ) if to_step is not None and row["explosion"] is not None else False
        row["restored_before"] = bool(before and guard["finite"])
    return row


def _alarm_cell(alarm: Optional[int], row: dict[str, Any]) -> str:
    if row["kind"] != "diverging":
        return "-" if alarm is None else f"false alarm @{alarm}"
    if alarm is None:
        return "miss"
    return f"{alarm} ({row['explosion'] - alarm:+d})" if row["explosion"] is not None else str(alarm)


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.3g}" if math.isfinite(x) else str(x)
    return str(x)


def _frac(n: int, d: int) -> str:
    return f"{n}/{d}" if d else "-"


def _caught(alarm: Optional[int], row: dict[str, Any]) -> bool:
    return alarm is not None and row["explosion"] is not None and alarm <= row["explosion"]


def scenario_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["scenario", "family", "kind", "split", "prec.", "opt.", "explosion", "unguarded final",
            "ours: action (lead)", "1st warning", "1st critical", "rollbacks", "stopped", "final loss", "ctrl final",
            "ends healthy", "finite", "SpikeDetection (lead)", "naive grad norm (lead)", "note"]
    body = []
    for r in rows:
        ours = ["error" if r.get("guard_error") else "-"] + ["-"] * 5
        if "action" in r:
            ours = [_alarm_cell(r["action"], r), _fmt(r["first_warning"]), _fmt(r["first_critical"]),
                    _fmt(r["rollbacks"]), _fmt(r["stopped"]), _fmt(r["final"])]
        plain = _fmt(r["plain_final"]) + ("" if r["plain_finite"] else " (non-finite weights)")
        note = "; ".join(x for x in (r["issue"], r.get("guard_error") or "") if x)
        prec = "bf16" if r["precision"].startswith("bf16") else "fp32"
        body.append([r["name"], r["family"], r["kind"], r["split"], prec, r["optimizer"], _fmt(r["explosion"]), plain,
                     *ours, _fmt(r.get("ctrl_final")), _fmt(r.get("ends_healthy")), _fmt(r.get("finite")),
                     _alarm_cell(r["spike"], r), _alarm_cell(r["naive"], r), note[:160]])
    return head, body


def calibration_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["diverging", "control", "trigger", "L0", "explosion", "peak / L0", "control peak / L0", "status"]
    body = [[r["name"], BY_NAME[r["name"]].pairs, str(r["trigger"]), f"{r['l0']:.3g}", _fmt(r["explosion"]),
             _fmt(r["peak"]), _fmt(r["ctrl_peak"]), r["issue"] or "ok"] for r in rows if r["kind"] == "diverging"]
    return head, body


def summary_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["split", "guard", "healthy + calibrated controls with an action",
            "warnings per healthy/control run (max / mean)",
            "diverging caught before 2 x L0", "diverging: first action restores a state before 2 x L0",
            "NaN/Inf caught on its step", "diverging ending healthy"]
    body = []
    uncalibrated = _uncalibrated_controls(rows)
    for split in sorted({r["split"] for r in rows}, reverse=True):
        part = [r for r in rows if r["split"] == split]
        calm = [r for r in part if r["kind"] != "diverging" and r["name"] not in uncalibrated]
        div = [r for r in part if r["kind"] == "diverging"]
        bad = [r for r in div if r.get("nonfinite_injection")]
        ours = [r for r in part if "action" in r]
        if ours:
            ocalm, odiv = [r for r in ours if r["kind"] != "diverging"], [r for r in ours if r["kind"] == "diverging"]
            # controls that failed calibration are counted apart: their own unguarded loss degrades
            apart = [r for r in ocalm if r["name"] in uncalibrated]
            ocalm = [r for r in ocalm if r["name"] not in uncalibrated]
            warns = [r["n_warnings"] for r in ocalm]
            acted = sum(r["action"] is not None for r in ocalm)
            note = (f" (+ {sum(r['action'] is not None for r in apart)}/{len(apart)} uncalibrated control)"
                    if apart else "")
            body.append([split, "DivergenceGuard (ours)", _frac(acted, len(ocalm)) + note,
                         f"{max(warns)} / {statistics.fmean(warns):.2f}" if warns else "-",
                         _frac(sum(_caught(r["action"], r) for r in odiv), len(odiv)),
                         _frac(sum(r["restored_before"] for r in odiv), len(odiv)),
                         _frac(sum(r["nonfinite_on_step"] for r in odiv if r.get("nonfinite_injection")),
                               sum(bool(r.get("nonfinite_injection")) for r in odiv)),
                         _frac(sum(r["ends_healthy"] for r in odiv), len(odiv))])
        elif any(r.get("guard_error") for r in part):
            body.append([split, "DivergenceGuard (ours)", "error", "-", "-", "-", "-", "-"])
        for label, key in (("SpikeDetection (offline)", "spike"), ("naive grad norm (offline)", "naive")):
            body.append([split, label, _frac(sum(r[key] is not None for r in calm), len(calm)), "-",
                         _frac(sum(_caught(r[key], r) for r in div), len(div)), "-",
                         _frac(sum(r[key] == r["trigger"] for r in bad), len(bad)), "-"])
    return head, body


def signal_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["signal (alert kind)", "split", "diverging runs, fired by the explosion", "lead median / min",
            "diverging runs, fired at all", "healthy + calibrated control runs fired (false alarms)"]
    ours = [r for r in rows if "kinds" in r]
    uncalibrated = _uncalibrated_controls(rows)
    body = []
    for kind in sorted({k for r in ours for k in r["kinds"]}):
        for split in sorted({r["split"] for r in ours}, reverse=True):
            part = [r for r in ours if r["split"] == split]
            div = [r for r in part if r["kind"] == "diverging"]
            fired = [r for r in div if kind in r["kinds"]]
            leads = [r["explosion"] - r["kinds"][kind] for r in fired if _caught(r["kinds"][kind], r)]
            calm = [r for r in part if r["kind"] != "diverging" and r["name"] not in uncalibrated]
            body.append([kind, split, _frac(len(leads), len(div)),
                         f"{statistics.median(leads):g} / {min(leads)}" if leads else "-", _frac(len(fired), len(div)),
                         _frac(sum(kind in r["kinds"] for r in calm), len(calm))])
    return head, body


def print_table(title: str, table: tuple[list[str], list[list[str]]], markdown: bool) -> None:
    head, body = table
    print(f"\n{title}\n")
    if markdown:
        def esc(c: str) -> str:
            return c.replace("|", "\\|")

        print("| " + " | ".join(map(esc, head)) + " |")
        print("|" + "---|" * len(head))
        for line in body:
            print("| " + " | ".join(map(esc, line)) + " |")
        return
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    for line in (head, *body):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())


# ----------------------------------------------------------------------------- main


def _cost(s: Scenario) -> float:
    """Rough relative run time, to start the long runs first."""
    return s.steps * {"gpt_ln": 3.0, "gpt_noln": 3.0, "hf_gpt2": 3.0, "lstm": 2.0, "cnn": 1.5,
                       "mlp": 1.0, "reg": 1.0}[s.family]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", choices=SPLITS + ("all",), default="all")
    parser.add_argument("--only", default=None, help="run the scenarios whose name contains this (and their pairs)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", default=None, help="write every row and trace to this file")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--guard-kwargs", default="{}", help="JSON dict passed to DivergenceGuard")
    parser.add_argument("--no-guard", action="store_true", help="skip our guard's runs (calibration)")
    parser.add_argument("--verify-spike", action="store_true",
                        help="also run the real SpikeDetection callback and compare it with the offline replay")
    args = parser.parse_args()
    guard_kwargs = json.loads(args.guard_kwargs)
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"torch {torch.__version__}, lightning {pl.__version__}, {args.workers} workers x 1 thread")
    start = time.perf_counter()

    chosen = {s.name for s in SCENARIOS
              if args.split in ("all", s.split) and (args.only is None or args.only in s.name)}
    chosen |= {BY_NAME[n].pairs for n in chosen if BY_NAME[n].pairs}
    scenarios = [s for s in SCENARIOS if s.name in chosen]
    modes = ["plain"] + ([] if args.no_guard else ["guard"]) + (["spike_check"] if args.verify_spike else [])
    tasks = sorted(((s.name, m, guard_kwargs) for s in scenarios for m in modes), key=lambda t: -_cost(BY_NAME[t[0]]))
    results: dict[str, dict[str, dict[str, Any]]] = {s.name: {} for s in scenarios}
    with mp.get_context("spawn").Pool(args.workers, initializer=_quiet) as pool:
        for name, mode, out in pool.imap_unordered(_task, tasks):
            results[name][mode] = out
    rows = [evaluate(s, results) for s in scenarios]

    print_table("Scenarios (lead = explosion step - alarm step; positive: before the loss passed 2 x L0)",
                scenario_table(rows), args.markdown)
    print_table("Calibration of the diverging scenarios (unguarded runs)", calibration_table(rows), args.markdown)
    print_table("Summary per split", summary_table(rows), args.markdown)
    if any("kinds" in r for r in rows):
        print_table("Our guard's signals", signal_table(rows), args.markdown)
    if args.verify_spike:
        same = [r["name"] for r in rows if r["spike_callback"] == r["spike"]]
        differ = [f"{r['name']} ({r['spike']} vs {r['spike_callback']})" for r in rows if r["name"] not in same]
        print(f"\nSpikeDetection replay vs callback: same first step on {len(same)}/{len(rows)} scenarios; "
              f"differ: {', '.join(differ) or 'none'}")
    runs = [out for res in results.values() for out in res.values() if "seconds" in out]
    print(f"\n{len(runs)} runs, {sum(o['seconds'] for o in runs):.0f} s of training; wall time "
          f"{time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"command": sys.argv, "guard_kwargs": guard_kwargs, "rows": rows, "results": results}, fh,
                      default=str)


if __name__ == "__main__":
    main()
