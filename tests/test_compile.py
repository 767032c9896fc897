"""The suite on a ``torch.compile``-d model (CPU, backend ``aot_eager``): no error, no recompilation storm,
the same values as the eager run.

The model's inner ``nn.Module`` is compiled (``self.net = torch.compile(Net())``), the way Lightning's docs
show it. Dynamo inlines the forward hooks our probes register on modules inside the compiled region, so a
hook that guards on Python state which changes every step (a list that grows, a counter) recompiles every
step until Dynamo's ``recompile_limit`` (8) and then silently runs that frame eagerly. The test counts the
graphs Dynamo builds on every step (``torch._dynamo.utils.counters``) and asserts none after the warm-up
(the first due step of every cadence and the first step that is not due).

``aot_eager`` traces and partitions the graph like inductor but runs it with eager kernels, so it checks
everything the monitors interact with (hooks, guards, recompiles) in a few seconds; inductor's codegen on
this machine's C++ compiler takes much longer, see ``benchmarks/bench_compile.py`` and ``docs/compile.md``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monitor import HealthMonitor
from lightning_monitor.callbacks.gradient_weight_alignment import GradientWeightAlignmentMonitor

torch_dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

STEPS = 60
EVERY = 10  # every monitor's cadence: due on 0, 10, 20, ...
#: losses and logged values of the compiled run against the eager run. aot_eager runs the same aten
#: kernels as eager; the only difference allowed is reassociation in the partitioned graph.
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.l2 = nn.Linear(32, 32)
        self.fc = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class Classifier(pl.LightningModule):
    def __init__(self, backend: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        net = Net()
        self.net = torch.compile(net, backend=backend) if backend else net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Recorder(Callback):
    """Per step: the loss, and how many graphs / frames Dynamo has compiled so far."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.graphs: list[tuple[int, int, int]] = []  # (step just run, unique graphs, frames compiled)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.graphs.append(
            (trainer.global_step - 1, counters["stats"]["unique_graphs"], counters["frames"]["total"])
        )


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * 32, 16, generator=g)
    return DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=32)


def _fit(backend: str | None, tmp_path) -> tuple[Recorder, dict[str, float], HealthMonitor]:
    torch_dynamo.reset()
    counters.clear()
    rec = Recorder()
    hm = HealthMonitor(
        spectral={"every_n_steps": EVERY}, noise_scale={"every_n_steps": EVERY}, gwa=True,
        guard={"every_n_steps": EVERY}, grades={"every_n_steps": EVERY},
    )
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=STEPS, logger=False, callbacks=[rec, hm], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(Classifier(backend), _loader())
    # a compiled module's parameters are named `net._orig_mod.l1.weight`: the per-layer keys carry it
    metrics = {k.replace("._orig_mod", ""): float(v) for k, v in trainer.callback_metrics.items()}
    return rec, metrics, hm


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise-stable reductions on both runs
    try:
        eager = _fit(None, tmp_path_factory.mktemp("eager"))
        compiled = _fit("aot_eager", tmp_path_factory.mktemp("compiled"))
        limit_hits = sum(v for k, v in counters["unimplemented"].items() if "recompile limit" in k.lower())
    finally:
        torch.set_num_threads(threads)
        torch_dynamo.reset()
    return eager, compiled, limit_hits


def test_compiled_model_trains_with_every_monitor_and_logs_the_eager_values(runs) -> None:
    (rec_e, met_e, hm_e), (rec_c, met_c, hm_c), _ = runs
    assert len(rec_c.losses) == len(rec_e.losses) == STEPS
    assert rec_c.losses == pytest.approx(rec_e.losses, rel=RTOL, abs=ATOL)
    # every monitor logged on the compiled model what it logged on the eager one
    assert set(met_c) == set(met_e)
    for prefix in ("sa/", "gns/", "gwa/"):
        assert any(k.startswith(prefix) for k in met_c), f"nothing logged under {prefix}"
    for key in sorted(met_e):
        assert met_c[key] == pytest.approx(met_e[key], rel=RTOL, abs=ATOL), key
    assert hm_c.noise_scale.ema.b_simple == pytest.approx(hm_e.noise_scale.ema.b_simple, rel=RTOL)
    assert hm_c.guard.rollbacks == hm_e.guard.rollbacks == []
    assert hm_c.gwa._head_name == "net._orig_mod.fc" and hm_e.gwa._head_name == "net.fc"


_GWA_HOOK_DISABLED = getattr(GradientWeightAlignmentMonitor._on_head_forward, "_torchdynamo_disable", False)


@pytest.mark.xfail(
    not _GWA_HOOK_DISABLED, strict=True,
    reason="GradientWeightAlignmentMonitor._on_head_forward is traced by Dynamo and guards on len(self._stash), "
    "which grows every step: one recompile per step until recompile_limit. Fix: decorate it with "
    "torch.compiler.disable (see docs/compile.md).",
)
def test_no_recompilation_after_warm_up(runs) -> None:
    _, (rec_c, _, _), limit_hits = runs
    assert limit_hits == 0, "a frame hit Dynamo's recompile_limit and now runs eagerly"
    # warm-up: step 0 (every monitor due), step 1 (nothing due), step EVERY (due again, hooks re-attached)
    base_graphs, base_frames = next((g, f) for s, g, f in rec_c.graphs if s == EVERY + 1)
    late = [(s, g, f) for s, g, f in rec_c.graphs if s > EVERY + 1]
    assert late and all((g, f) == (base_graphs, base_frames) for _, g, f in late), [
        (s, g - base_graphs, f - base_frames) for s, g, f in late if (g, f) != (base_graphs, base_frames)
    ]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Deep(pl.LightningModule):
    """Ten blocks (21 Linear layers) compiled: more hooked modules than Dynamo's recompile limit (8)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.compile(nn.Sequential(nn.Linear(16, 32), *[_Block() for _ in range(10)], nn.Linear(32, 4)),
                                 backend="aot_eager")

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_the_probes_hooks_do_not_recompile_per_module(tmp_path) -> None:
    # traced, the per-example probe's hooks guarded on each module's name and weight shape: one recompilation per
    # hooked module at the first due step, past Dynamo's limit (the frames then ran eagerly for good)
    torch_dynamo.reset()
    counters.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hm = HealthMonitor(spectral={"every_n_steps": 5}, noise_scale={"every_n_steps": 5}, gwa=False,
                           guard={"every_n_steps": 5})
        pl.Trainer(accelerator="cpu", max_steps=30, logger=False, callbacks=[hm], enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False,
                   default_root_dir=str(tmp_path)).fit(_Deep(), _loader())
        limit_hits = sum(v for k, v in counters["unimplemented"].items() if "recompile limit" in k.lower())
    finally:
        torch.set_num_threads(threads)
        torch_dynamo.reset()
    assert limit_hits == 0
    assert hm.noise_scale.ema.count == 6 and hm.spectral._n_checks == 6  # every check measured
