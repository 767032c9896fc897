"""DivergenceGuard on a sharded model: FSDP2 (Lightning's ModelParallelStrategy, ``fully_shard``, DTensor
parameters and gradients) on 2 CPU ranks (gloo), against the same model, data and seed under DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "sharded_guard.py")


# what a parent process's earlier distributed run leaves in the environment (ddp_spawn sets MASTER_PORT in
# the test process): a launched job must choose its own port, or two jobs collide and wait for each other
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _finished(returncode: int, log: str, files: list[str]) -> bool:
    """Whether a two-rank job ran to its end: exit status 0; or the abort of a gloo teardown at interpreter exit
    (SIGABRT, "terminate called without an active exception", see ``fit_ddp_spawn`` in conftest.py), seen once on this
    test's DDP job on a quiet 2-core machine although the script destroys its group, *after* the fit ended and every
    rank wrote its results: those are judged as usual, and the abort is reported as a warning and on stderr."""
    if returncode == 0:
        return True
    aborted_at_exit = (returncode == -6 and "terminate called without an active exception" in log
                       and all(os.path.exists(f) for f in files))
    if aborted_at_exit:
        message = f"a rank aborted at interpreter exit after writing its results ({', '.join(files)})"
        warnings.warn(message)
        print(f"WARNING: {message}", file=sys.stderr)
    return aborted_at_exit


def _run(strategy: str, out: str) -> list[dict]:
    env = _clean_env()
    proc = subprocess.run([sys.executable, SCRIPT, "--strategy", strategy, "--out", out], capture_output=True,
                          text=True, timeout=300, env=env)
    files = [os.path.join(out, f"{strategy}-rank{r}.json") for r in (0, 1)]
    assert _finished(proc.returncode, proc.stdout + proc.stderr, files), proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.load(open(f)) for f in files]


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


MONITORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "sharded_monitors.py")


def _close(a: dict, b: dict, rel: float) -> bool:
    return a.keys() == b.keys() and all(v == pytest.approx(b[k], rel=rel, abs=1e-7) for k, v in a.items())


@pytest.mark.parametrize("validation", [False, True], ids=["no validation", "validation every 8 steps"])
def test_monitors_under_fsdp2_log_what_they_log_under_ddp(tmp_path, validation):
    """SpectralAlignmentMonitor, GradientEarlyStopping (freezing a component mid-run), GradientNoiseScaleMonitor
    (per_example) and GradientWeightAlignmentMonitor on the same model, data and seed: FSDP2 (2 gloo ranks,
    DTensor parameters) against DDP. Both runs at once (each is mostly process start-up). With a validation loop
    (and the last Linear in the root's FSDP unit, which stays gathered after a forward with no backward): the noise
    scale's probe was built over the gathered parameters at the first due step after each validation, left the
    root's out and restarted its averages twice a validation (every value differed from DDP's); GradES took the
    root's Linear, beside two sharded ones of another class, for no repeated layer and did not watch it."""
    env = _clean_env()
    procs = {}
    for s in ("fsdp2", "ddp"):
        (tmp_path / s).mkdir()
        procs[s] = subprocess.Popen([sys.executable, MONITORS, "--strategy", s, "--out", str(tmp_path / s)]
                                    + (["--val"] if validation else []),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    logs = {s: p.communicate(timeout=300)[0] for s, p in procs.items()}
    for s, p in procs.items():
        assert _finished(p.returncode, logs[s], [str(tmp_path / s / f"{s}-rank{r}.json") for r in (0, 1)]), logs[s][-3000:]
    res = {s: [json.load(open(tmp_path / s / f"{s}-rank{r}.json")) for r in (0, 1)] for s in procs}
    for s in res:
        for r in (0, 1):
            assert res[s][r]["error"] is None, (s, r, res[s][r]["error"])
    fsdp, ddp = res["fsdp2"], res["ddp"]
    for r in (0, 1):
        for mon in ("sa", "grades", "gns", "gwa"):
            got, want = fsdp[r]["logged"][mon], ddp[r]["logged"][mon]
            assert got, (mon, "logged nothing")
            assert got.keys() == want.keys(), mon  # the same checks, on the same steps
            for step in want:  # per-rank values (SA's alignments, GNS's small batch are each rank's own data)
                assert _close(got[step], want[step], rel=1e-4), (mon, r, step, got[step], want[step])
        assert fsdp[r]["alerts"] == ddp[r]["alerts"]
    # decisions identical on both ranks: GradES froze the same component on the same step, as under DDP
    assert fsdp[0]["frozen"] == fsdp[1]["frozen"] == ddp[0]["frozen"] == {"net.2": 10}
    for mon in ("grades", "gwa"):  # reduced across ranks: the same values on both
        assert fsdp[0]["logged"][mon] == fsdp[1]["logged"][mon]
    # SA's top singular values come from the gathered weight: the same on both ranks
    for step, vals in fsdp[0]["logged"]["sa"].items():
        sig = {k: v for k, v in vals.items() if k.endswith("/sigma")}
        assert sig and sig == {k: fsdp[1]["logged"]["sa"][step][k] for k in sig}


def test_noise_scale_and_spectral_alignment_under_fsdp2_with_ranks_using_different_layers_as_under_ddp(tmp_path):
    # the squared norms of sharded gradients are reduced across ranks by position: the rank that left a layer out
    # (its batches do not use it) listed its parameters in another order, and summed other parameters' shards into
    # its own (a coverage of 0.99 logged for a true share of 0.009, tr(Sigma) below 0)
    env = _clean_env()
    procs = {}
    for s in ("fsdp2", "ddp"):
        (tmp_path / s).mkdir()
        procs[s] = subprocess.Popen([sys.executable, MONITORS, "--strategy", s, "--out", str(tmp_path / s), "--only",
                                     "gns,sa", "--branch", "--steps", "12"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    logs = {s: p.communicate(timeout=300)[0] for s, p in procs.items()}
    for s, p in procs.items():
        assert _finished(p.returncode, logs[s], [str(tmp_path / s / f"{s}-rank{r}.json") for r in (0, 1)]), logs[s][-3000:]
    res = {s: [json.load(open(tmp_path / s / f"{s}-rank{r}.json")) for r in (0, 1)] for s in procs}
    for r in (0, 1):
        got, want = res["fsdp2"][r]["logged"]["gns"], res["ddp"][r]["logged"]["gns"]
        assert got.keys() == want.keys() and want
        for step in want:
            assert _close(got[step], want[step], rel=1e-4), (r, step, got[step], want[step])
    # rank 1 measured without the layer: a coverage below 1 there, all of it on rank 0
    assert all(v["gns/coverage"] == 1.0 for v in res["fsdp2"][0]["logged"]["gns"].values())
    assert all(v["gns/coverage"] < 1.0 for v in res["fsdp2"][1]["logged"]["gns"].values())
    # spectral alignment gathers every sharded layer on every rank, in one order, also the layer one rank's batches do
    # not reach (the ranks gathered different layers: gloo aborted); each rank measures the layers it ran, as under DDP
    for r in (0, 1):
        got, want = res["fsdp2"][r]["logged"]["sa"], res["ddp"][r]["logged"]["sa"]
        assert got.keys() == want.keys() and want
        for step in want:
            sig = {k: v for k, v in want[step].items() if k.endswith("/sigma")}
            assert sig and got[step].keys() == want[step].keys()
            assert _close({k: got[step][k] for k in sig}, sig, rel=1e-4), (r, step)


def test_noise_scale_refuses_what_fsdp2_cannot_measure():
    from types import SimpleNamespace

    from lightning_monitor import GradientNoiseScaleMonitor

    trainer = SimpleNamespace(strategy=SimpleNamespace(_tensor_parallel_size=1))
    with pytest.raises(ValueError, match="communication hook"):
        GradientNoiseScaleMonitor._check_model_parallel(trainer, "ddp")
    with pytest.raises(ValueError, match="reduce-scatters every micro-batch"):
        GradientNoiseScaleMonitor._check_model_parallel(trainer, "accumulation")
    GradientNoiseScaleMonitor._check_model_parallel(trainer, "per_example")
    trainer.strategy._tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensor parallelism"):
        GradientNoiseScaleMonitor._check_model_parallel(trainer, "per_example")


@pytest.mark.parametrize("kind", ["FSDPStrategy", "DeepSpeedStrategy"])
def test_flat_sharding_strategies_are_refused_at_setup(kind):
    """FSDP1 and DeepSpeed keep parameters as flat 1-D shards (GPU only: not run here): refused at setup."""
    from lightning_monitor import GradientNoiseScaleMonitor, GradientWeightAlignmentMonitor, SpectralAlignmentMonitor

    trainer = type("Trainer", (), {})()  # weak-referenceable, unlike a SimpleNamespace
    trainer.strategy, trainer.loggers, trainer.default_root_dir = type(kind, (), {})(), [], "."
    trainer.global_rank, trainer.world_size = 0, 1
    for cls in (SpectralAlignmentMonitor, GradientNoiseScaleMonitor, GradientWeightAlignmentMonitor):
        with pytest.raises(ValueError, match=f"does not support {kind}.*ModelParallelStrategy"):
            cls().setup(trainer, torch.nn.Linear(2, 2), "fit")


def test_tensor_parallel_is_refused_at_setup_by_the_activation_readers():
    from lightning_monitor import GradientWeightAlignmentMonitor, SpectralAlignmentMonitor

    trainer = type("Trainer", (), {})()
    trainer.strategy = type("ModelParallelStrategy", (), {"_tensor_parallel_size": 2})()
    trainer.loggers, trainer.default_root_dir, trainer.global_rank, trainer.world_size = [], ".", 0, 1
    for cls in (SpectralAlignmentMonitor, GradientWeightAlignmentMonitor):
        with pytest.raises(ValueError, match="does not support tensor parallelism"):
            cls().setup(trainer, torch.nn.Linear(2, 2), "fit")


def test_the_guard_refuses_deepspeed_and_sums_fsdp1_shards(tmp_path):
    """DeepSpeed holds gradients and optimizer state in its engine: the guard refuses it at setup (idle under
    the preset). FSDP1 (GPU only: not run here) keeps plain flat gradient shards: the guard sums their
    squared norms across the ranks, as it does for DTensor shards."""
    from lightning_monitor import DivergenceGuard
    from lightning_monitor.callbacks.base import NothingToWatch

    def fake(kind):
        trainer = type("Trainer", (), {})()
        trainer.strategy, trainer.loggers, trainer.default_root_dir = type(kind, (), {})(), [], str(tmp_path)
        trainer.global_rank, trainer.world_size, trainer.global_step = 0, 1, 0
        return trainer

    with pytest.raises(NothingToWatch, match="DeepSpeedStrategy holds the gradients"):
        DivergenceGuard().setup(fake("DeepSpeedStrategy"), torch.nn.Linear(2, 2), "fit")
    idle = DivergenceGuard()
    idle.idle_when_nothing_to_watch = True
    idle.setup(fake("DeepSpeedStrategy"), torch.nn.Linear(2, 2), "fit")
    assert "DeepSpeed" in idle.idle_reason
    guard = DivergenceGuard()
    guard.setup(fake("FSDPStrategy"), torch.nn.Linear(2, 2), "fit")
    assert guard._flat_shards and guard.idle_reason is None
    plain = DivergenceGuard()
    plain.setup(fake("DDPStrategy"), torch.nn.Linear(2, 2), "fit")
    assert not plain._flat_shards
