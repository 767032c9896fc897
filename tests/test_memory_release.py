"""Nothing of a fit outlives it: once the trainer, the module and the monitors are dropped, Python's collector frees
them (the autograd graph of a fit's last loss, which the trainer keeps, holds the hooks of the monitors; a hook that
held its monitor or probe strongly made a cycle the collector cannot see, and every fit of a process kept its model,
activations and buffers: gigabytes a fit on a GPU)."""

from __future__ import annotations

import gc
import weakref

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_monitor as lm


def _fit_and_drop(make_module, loader, callbacks, root) -> tuple[list[weakref.ref], int]:
    """Fit, drop every name of the fit, collect; the weak references to the fit's objects still alive, and how many
    there were."""
    module = make_module()
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root))
    trainer.fit(module, loader)
    refs = [weakref.ref(module), weakref.ref(trainer)] + [weakref.ref(cb) for cb in callbacks]
    refs += [weakref.ref(p) for p in module.parameters()]
    n = len(refs)
    del module, trainer, callbacks
    gc.collect()
    return [r for r in refs if r() is not None], n


SLOTS = ("spectral", "noise_scale", "gwa", "guard", "grades")


# the monitors whose hooks the autograd graph holds, alone, and the whole suite (every monitor's paths)
@pytest.mark.parametrize("only", ["noise_scale", "gwa", "all"])
def test_a_fit_of_the_gpt_leaves_nothing_alive(tmp_path, tiny_gpt, only):
    _, loader = tiny_gpt(n_samples=8 * 12)
    settings = {slot: True for slot in SLOTS} if only == "all" else {slot: slot == only for slot in SLOTS}
    if settings["grades"]:
        settings["grades"] = {"every_n_steps": 2, "grace_steps": 2}
    alive, n = _fit_and_drop(lambda: tiny_gpt()[0], loader, [lm.HealthMonitor(**settings)], tmp_path)
    assert n > 3 and not alive, f"{len(alive)} of {n} objects of the fit still alive: {[type(r()).__name__ for r in alive][:6]}"


class _Convnet(pl.LightningModule):
    """A small convolutional classifier (the per-example probe's fused convolution path and GWA's head)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_fit_of_a_convnet_with_the_whole_suite_leaves_nothing_alive(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 3, 8, 8, generator=g), torch.randint(0, 5, (96,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    # (no name in this frame holds the monitor)
    alive, n = _fit_and_drop(_Convnet, loader, [lm.HealthMonitor(noise_scale={"every_n_steps": 2},
                                                                 spectral={"every_n_steps": 2})], tmp_path)
    assert not alive, f"{len(alive)} of {n} objects of the fit still alive: {[type(r()).__name__ for r in alive][:6]}"


def test_after_a_fit_the_module_carries_nothing_of_the_suite_but_the_frozen_components(tmp_path, tiny_gpt):
    """No hook, no patched ``forward`` left on any submodule or parameter; GradES's frozen components stay frozen (as
    the docs say), every other parameter trainable."""
    module, loader = tiny_gpt(n_samples=8 * 60)

    def hooks(m):
        return {n: (len(x._forward_hooks), len(x._forward_pre_hooks), len(x._backward_hooks),
                    len(x._backward_pre_hooks), "forward" in x.__dict__) for n, x in m.named_modules()}

    before = hooks(module)
    health = lm.HealthMonitor(grades={"every_n_steps": 5, "grace_steps": 10, "tau": 10.0})
    trainer = pl.Trainer(max_steps=60, accelerator="cpu", callbacks=[health], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                         logger=pl.loggers.TensorBoardLogger(str(tmp_path)))
    trainer.fit(module, loader)
    assert hooks(module) == before
    assert all(not p._backward_hooks for p in module.parameters() if p._backward_hooks is not None)
    frozen = {id(p) for p in health.grades.frozen_parameters(trainer)}
    assert frozen, "GradES at tau=10 freezes components"
    assert all(p.requires_grad == (id(p) not in frozen) for p in module.parameters())


def _graph_tensors(root) -> list:
    """Tensors with an autograd history reachable from ``root`` through plain containers and the package's own objects
    (modules and their parameters are not entered: they are the model's)."""
    import gc as _gc

    seen, out, todo = set(), [], [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (nn.Module, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None:
                out.append(obj)
            continue
        if isinstance(obj, (dict, list, tuple, set)) or type(obj).__module__.startswith("lightning_monitor"):
            todo.extend(_gc.get_referents(obj))
    return out


def test_the_noise_scale_probe_holds_no_activations_between_its_checks(tmp_path, tiny_gpt):
    """Between two checks, the per-example probe keeps nothing of the last probed step: it kept the inputs and outputs of
    every hooked module of that forward, with their autograd graphs, until the next check."""
    module, loader = tiny_gpt(n_samples=8 * 30)
    gns = lm.GradientNoiseScaleMonitor(every_n_steps=4)
    trainer = pl.Trainer(max_steps=30, accelerator="cpu", callbacks=[gns], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    assert gns._probe is not None and trainer.callback_metrics.get("gns/b_simple") is not None  # the probe ran
    held = _graph_tensors(gns)
    assert not held, f"{len(held)} tensors with a graph held: {[tuple(t.shape) for t in held][:5]}"
