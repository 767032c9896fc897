"""DivergenceGuard on a sharded model: FSDP2 (Lightning's ModelParallelStrategy, ``fully_shard``, DTensor
parameters and gradients) on 2 CPU ranks (gloo), against the same model, data and seed under DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "sharded_guard.py")


def _run(strategy: str, out: str) -> list[dict]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, SCRIPT, "--strategy", strategy, "--out", out], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.load(open(os.path.join(out, f"{strategy}-rank{r}.json"))) for r in (0, 1)]


def test_guard_under_fsdp2_judges_and_acts_as_under_ddp(tmp_path):
    fsdp = _run("fsdp2", str(tmp_path))
    ddp = _run("ddp", str(tmp_path))
    # the guard judged every step on both ranks, the same values on both (the ranks' mean loss, the global norm)
    assert [s for s, _, _ in fsdp[0]["seen"]] == list(range(50))
    assert fsdp[0]["seen"] == fsdp[1]["seen"]
    # ... equal to the unsharded run's: the same mean loss, and the norm of the full gradient from the shards
    for (s, loss, gnorm), (s2, loss2, gnorm2) in zip(fsdp[0]["seen"], ddp[0]["seen"]):
        assert s == s2 and loss == pytest.approx(loss2, rel=1e-6) and gnorm == pytest.approx(gnorm2, rel=1e-5)
    # the learning-rate jump at step 33: both ranks roll back together, as under DDP, and stay identical
    assert fsdp[0]["rollbacks"] == fsdp[1]["rollbacks"] == ddp[0]["rollbacks"] == [[34, 30]]
    assert fsdp[0]["alerts"] == ddp[0]["alerts"] == [[34, "loss_explosion"]]
    assert fsdp[0]["weights"] == fsdp[1]["weights"]
    assert fsdp[0]["weights"] == pytest.approx(ddp[0]["weights"], rel=1e-5, abs=1e-6)
