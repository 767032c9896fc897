"""The CUDA path: the methods against their oracles on the GPU, the suite in real ``Trainer.fit`` runs on the GPU (three
precisions), the guard's rollback (its snapshot's copies to the host do not wait) and no host sync on steps where no
monitor is due, caught by CUDA's own sync detector (``torch.cuda.set_sync_debug_mode``).

Skipped where there is no GPU (CI has none): ``python -m pytest -q tests/test_cuda.py`` on a machine with one.
"""

from __future__ import annotations

import os
import traceback
import warnings
from contextlib import contextmanager

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import tb_scalars
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_monitor
from lightning_monitor import (DivergenceGuard, GradientEarlyStopping, GradientNoiseScaleMonitor,
                               GradientWeightAlignmentMonitor, HealthMonitor, SpectralAlignmentMonitor)
from lightning_monitor.functional import spectral_alignment, top_singular_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PACKAGE_DIR = os.path.dirname(os.path.abspath(lightning_monitor.__file__))
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _exact_float32():
    """TF32 off for the oracles' comparisons (cuDNN convolutions use it by default)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# ----------------------------------------------------------------------------- the methods against their oracles


@pytest.mark.parametrize("strategy", ["auto", "gram", "materialize"])
@pytest.mark.parametrize("model_name", ["MLP", "CNN", "TinyTransformer"])
def test_per_example_norms_match_torch_func_on_cuda(model_name, strategy):
    import test_per_example as t

    if model_name == "CNN" and strategy != "auto":
        pytest.skip("the strategies of layers on sequences")
    torch.manual_seed(0)
    model = getattr(t, model_name)().to(CUDA)
    if model_name == "MLP":
        x, y, loss = torch.randn(9, 12, device=CUDA), torch.randint(0, 5, (9,), device=CUDA), F.cross_entropy
    elif model_name == "CNN":
        x, y, loss = torch.randn(6, 3, 8, 8, device=CUDA), torch.randint(0, 5, (6,), device=CUDA), F.cross_entropy
    else:
        x, y, loss = (torch.randint(0, 11, (5, 7), device=CUDA), torch.randint(0, 11, (5, 7), device=CUDA), t.ce_seq)
    probe = t.check(model, loss, x, y, linear_strategy=strategy)
    assert probe.squared_norms().device.type == "cuda"


def test_per_example_norms_under_bf16_autocast_close_to_float32():
    import test_per_example as t

    torch.manual_seed(0)
    model = t.TinyTransformer().to(CUDA)
    x, y = torch.randint(0, 11, (6, 7), device=CUDA), torch.randint(0, 11, (6, 7), device=CUDA)
    exact = t.probe_run(model, t.ce_seq, x, y).squared_norms()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        low = t.probe_run(model, t.ce_seq, x, y).squared_norms()
    assert torch.isfinite(low).all()
    assert t.rel_err(low, exact) < 5e-2


@pytest.mark.parametrize("shape", [(64, 64), (32, 200), (300, 48)])
def test_top_singular_pair_matches_svd_on_cuda(shape):
    from test_spectral_functional import gapped_matrix, svd_top

    w = gapped_matrix(*shape, ratio=0.9, seed=0) * 3.7
    sigma, u, v = top_singular_pair(w.to(CUDA))
    s, u_ref, v_ref = svd_top(w)
    assert sigma.device.type == "cuda"
    assert abs(float(sigma) - float(s[0])) / float(s[0]) < 1e-4
    assert abs(float(v.double().cpu() @ v_ref)) > 0.999 and abs(float(u.double().cpu() @ u_ref)) > 0.999


def test_spectral_alignment_matches_the_cosine_on_cuda():
    torch.manual_seed(0)
    x, v = torch.randn(40, 24, device=CUDA), torch.randn(24, device=CUDA)
    got = spectral_alignment(x, v)
    ref = (x.double() @ v.double()) / (x.double().norm(dim=1) * v.double().norm())
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the suite in Trainer.fit on the GPU


def _gpu_trainer(tmp_path, callbacks, steps, **kw):
    return pl.Trainer(max_steps=steps, accelerator="gpu", devices=1, callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                      log_every_n_steps=5, **kw)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_the_whole_suite_fits_on_cuda_and_logs_every_method(tmp_path, tiny_gpt, precision):
    pl.seed_everything(0, verbose=False)
    module, loader = tiny_gpt(n_samples=8 * 40)
    health = HealthMonitor(grades={"every_n_steps": 5, "grace_steps": 10})
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    where = _OnTheDevice()
    trainer = _gpu_trainer(tmp_path, [health, where], 80, precision=precision, logger=logger, max_epochs=2)
    trainer.fit(module, loader)
    assert trainer.global_step == 80
    assert where.seen == {"cuda"}
    scalars = tb_scalars(logger.log_dir)
    for prefix in ("sa/", "gns/", "gwa/"):
        tags = [t for t in scalars if t.startswith(prefix)]
        assert tags, (prefix, sorted(scalars)[:20])
        assert all(v == v for t in tags for _, v in scalars[t]), prefix  # no NaN logged
    critical = [a for a in health.guard.hub.history if a.severity == "critical"]
    assert not critical, critical



def test_the_whole_suite_fits_on_cuda_with_deterministic_algorithms(tmp_path, tiny_gpt):
    """``Trainer(deterministic=True)`` turns on ``torch.use_deterministic_algorithms``, under which a CUDA op with no
    deterministic kernel raises (GWA's histogram of the scores used ``torch.histc``, one of them)."""
    pl.seed_everything(0, verbose=False)
    module, loader = tiny_gpt(n_samples=8 * 40)
    health = HealthMonitor(grades={"every_n_steps": 5, "grace_steps": 10})
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = _gpu_trainer(tmp_path, [health], 80, logger=logger, max_epochs=2, deterministic=True)
    trainer.fit(module, loader)
    assert trainer.global_step == 80
    scalars = tb_scalars(logger.log_dir)
    assert any(t.startswith("gwa/") for t in scalars), sorted(scalars)[:20]
    assert not [a for a in health.guard.hub.history if a.severity == "critical"]

class _OnDevice:
    """``test_guard_rollback._Regression`` with its data moved to the module's device when the fit starts."""

    @staticmethod
    def make(**kw):
        from test_guard_rollback import _Regression

        class Regression(_Regression):
            def on_fit_start(self):
                self.x, self.y = self.x.to(self.device), self.y.to(self.device)

        return Regression(**kw)


class _OnTheDevice(pl.Callback):
    """Records, at the end of every batch, whether every parameter is on the GPU (Lightning moves the module back to
    the CPU when the fit ends)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.seen |= {p.device.type for p in pl_module.parameters()}


@pytest.mark.parametrize("copies", ["flat", "staged", "pinned", "waiting"])
def test_rollback_on_cuda_restores_the_exact_state_of_its_snapshot(tmp_path, monkeypatch, copies):
    """The snapshot's copies to the host, made each of four ways (gathered into one buffer per dtype on the device then
    carried on a side stream, the same per tensor, straight to pinned memory, blocking), give back exactly what they
    copied: the state restored is bit for bit the
    state a run trained for exactly that many steps holds. On the GPU the guard reads each step's values two steps
    later (``lag_steps``): the surge at step 61 is acted on at step 63, back to the snapshot of step 55 (the one of
    step 25 was held back by the detectors, as on the CPU with ``lag_steps=2``)."""
    from test_guard_rollback import _Capture, _assert_same

    from lightning_monitor import snapshot

    monkeypatch.setattr(snapshot, "_DEVICE_COPIES", copies)
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=5)  # a snapshot every 25 steps
    capture = _Capture(step=64)  # the end of step 63, the one acted at
    pinned: list[bool] = []
    where = _OnTheDevice()

    class Pinned(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 58:
                state = guard._snapshots[-1].state()
                # AdamW's step counts stay on the host (not capturable): copied there, not pinned
                moments = [t for k, t in state["optimizers"][0]["state"][0].items() if k != "step"]
                pinned.extend(t.is_pinned() for t in [*state["module"].values(), *moments])

    trainer = _gpu_trainer(tmp_path / "a", [guard, capture, Pinned(), where], 120, logger=False)
    trainer.fit(_OnDevice.make(glitch=(60, 61, 62)))
    assert [(r["step"], r["to_step"]) for r in guard.rollbacks] == [(63, 55)]
    assert guard.stopped_step is None and trainer.global_step == 120
    # the copies that do not wait go to pinned memory
    assert pinned and (not any(pinned) if copies == "waiting" else all(pinned)), pinned
    assert where.seen == {"cuda"}

    pl.seed_everything(0)
    ref = _Capture(step=55)
    _gpu_trainer(tmp_path / "ref", [ref], 55, logger=False).fit(_OnDevice.make())
    _assert_same(capture.module, ref.module)
    assert capture.optim.keys() == ref.optim.keys()
    for i in ref.optim:
        _assert_same(capture.optim[i], ref.optim[i])


@pytest.mark.parametrize("share, side", [(0.5, True), (0.0, False)])
def test_flat_copies_gather_on_the_device_and_travel_on_a_side_stream(monkeypatch, share, side):
    """``"flat"``: one pinned buffer per dtype, the copies its views; on a side stream unless the device lacks the
    memory for the gathering copy (then straight, on the training stream)."""
    from lightning_monitor import snapshot

    monkeypatch.setattr(snapshot, "_STAGING_SHARE", share)
    g = torch.Generator(device=CUDA).manual_seed(0)
    src = {"a": torch.randn(1000, device=CUDA, generator=g), "b": [torch.randn(3, 5, device=CUDA, generator=g).t(),
           torch.randn(7, device=CUDA, dtype=torch.bfloat16, generator=g)], "c": torch.arange(3)}
    flats: dict = {}
    pending: list = []
    out = snapshot._to_host(src, None, pending, flats)
    assert len(flats) == 2 and all(f.is_pinned() for f in flats.values())
    assert {p != torch.cuda.current_stream() for p in pending} == {side}
    for stream in dict.fromkeys(pending):
        event = torch.cuda.Event()
        event.record(stream)
        event.synchronize()
    assert torch.equal(out["a"], src["a"].cpu()) and torch.equal(out["b"][0], src["b"][0].cpu())
    assert torch.equal(out["b"][1], src["b"][1].cpu()) and torch.equal(out["c"], src["c"])
    assert out["a"].untyped_storage().data_ptr() == out["b"][0].untyped_storage().data_ptr()


def test_staged_copies_run_on_a_side_stream_unless_the_device_lacks_the_memory(monkeypatch):
    from lightning_monitor import snapshot

    monkeypatch.setattr(snapshot, "_DEVICE_COPIES", "staged")
    src = [torch.randn(1000, device=CUDA), torch.randn(3, 5, device=CUDA)]
    for share, side in ((0.5, True), (0.0, False)):
        monkeypatch.setattr(snapshot, "_STAGING_SHARE", share)
        dst = [torch.empty(t.shape, pin_memory=True) for t in src]
        pending: list = []
        snapshot._copy_from_devices(dst, src, pending)
        assert (pending[0] != torch.cuda.current_stream()) == side and len(pending) == 1
        event = torch.cuda.Event()
        event.record(pending[0])
        event.synchronize()
        for d, t in zip(dst, src):
            assert torch.equal(d, t.cpu())


def test_a_stop_on_cuda_leaves_the_last_good_weights(tmp_path):
    pl.seed_everything(0)
    guard = DivergenceGuard(every_n_steps=5, snapshot_every_n_checks=2, action="stop")
    where = _OnTheDevice()
    trainer = _gpu_trainer(tmp_path, [guard, where], 200, logger=False)
    module = _OnDevice.make(unstable_from=60)
    trainer.fit(module)
    assert guard.stopped_step is not None and guard.stopped_step < 80
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert where.seen == {"cuda"}


# ----------------------------------------------------------------------------- no host sync where nothing is due


@contextmanager
def package_syncs(trainer_ref: list):
    """The optimizer steps at which lightning_monitor's code made CUDA wait for the device, as CUDA's sync detector
    reports them (any synchronizing call: ``item``, a blocking copy, ``nonzero``, a boolean mask...)."""
    steps: list[tuple[int, str]] = []
    before = torch.cuda.get_sync_debug_mode()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return show(message, category, filename, lineno, file, line)
        ours = [f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE_DIR)]
        if ours and trainer_ref:
            steps.append((trainer_ref[0].global_step, f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno} "
                                                      f"{ours[-1].name}"))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield steps
        finally:
            torch.cuda.set_sync_debug_mode(before)
            warnings.showwarning = show


def _count_syncs(tmp_path, callbacks, module, loader, steps):
    trainer = _gpu_trainer(tmp_path, callbacks, steps, logger=False)
    ref = [trainer]
    with package_syncs(ref) as found:
        trainer.fit(module, loader)
    return found


def test_the_sync_detector_sees_a_sync_from_the_package(tmp_path, tiny_gpt, monkeypatch):
    """The detector works: an ``item`` planted in a monitor's hook on every step (code compiled under a file name of
    the package, as the package's own code is) is found on every step."""
    module, loader = tiny_gpt()
    sa = SpectralAlignmentMonitor(every_n_steps=7, warmup_steps=3)
    namespace = {"torch": torch, "original": SpectralAlignmentMonitor.on_train_batch_end}
    source = ("def planted(self, trainer, pl_module, outputs, batch, batch_idx):\n"
              "    torch.ones((), device=pl_module.device).item()\n"
              "    return original(self, trainer, pl_module, outputs, batch, batch_idx)\n")
    exec(compile(source, os.path.join(PACKAGE_DIR, "planted.py"), "exec"), namespace)
    monkeypatch.setattr(SpectralAlignmentMonitor, "on_train_batch_end", namespace["planted"])
    found = _count_syncs(tmp_path, [sa], module, loader, 12)
    assert {s for s, where in found if where.startswith("planted.py")} >= set(range(1, 13))


def test_step_monitors_sync_only_on_due_steps_on_cuda(tmp_path, tiny_gpt):
    module, loader = tiny_gpt()
    monitors = [SpectralAlignmentMonitor(every_n_steps=7, warmup_steps=3), GradientNoiseScaleMonitor(every_n_steps=6),
                GradientEarlyStopping(every_n_steps=5, grace_steps=1000)]
    steps = 40
    found = _count_syncs(tmp_path, monitors, module, loader, steps)
    due = {s for m in monitors for s in range(steps) if m.is_due(s)}
    # a hook at the end of a batch reads global_step after the update: a check of step s may report s + 1
    off = sorted({(s, where) for s, where in found if s not in due and s - 1 not in due})
    assert not off, f"host syncs on steps where no monitor was due: {off}"
    assert found, "the checks sync when they log"


def test_the_guard_does_not_sync_between_its_snapshots_on_cuda(tmp_path, tiny_gpt):
    """The guard judges every step from copies started two steps earlier (an event each): no sync between its
    snapshot checks, where one finiteness check reads one number; the snapshot's copies do not wait."""
    module, loader = tiny_gpt()
    guard = DivergenceGuard(every_n_steps=10, snapshot_every_n_checks=2)
    found = _count_syncs(tmp_path, [guard], module, loader, 45)
    during = [(s, where) for s, where in found if 0 < s < 45]
    assert {s for s, _ in during} <= {20, 21, 40, 41}, during


def test_gwa_syncs_only_at_epoch_ends_on_cuda(tmp_path, tiny_gpt):
    module, loader = tiny_gpt(n_samples=8 * 12)  # 12 steps per epoch
    gwa = GradientWeightAlignmentMonitor(log_histograms=False)
    trainer = _gpu_trainer(tmp_path, [gwa], 36, logger=False)
    with package_syncs([trainer]) as found:
        trainer.fit(module, loader)
    assert found
    assert {s for s, _ in found if s % 12} <= {1, 2}, sorted(found)
