"""Models whose use of their weights changes after the noise-scale monitor's first check, or that compute with another
tensor than a layer's parameter. Each was measured wrong or crashed the fit: a gradient penalty switched on after the
first check (two backward passes through each layer in one step) stopped the fit with "the backward ... has not
finished"; a decoder tied to an encoder's weight from the second batch on, and ``ModelPruning`` masking weights at an
epoch's end, left those weights covered with per-example norms 40-130% off, coverage 1.0 and no word; a weight
replaced through ``torch.func.functional_call`` (a hypernetwork) was counted as measured with norms of a gradient it
never received. Each is now left out with its reason, and what stays covered is exact."""

from __future__ import annotations

import copy
import tempfile

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelPruning
from torch import nn

from lightning_monitor import GradientNoiseScaleMonitor, PerExampleGradNorms

B, D, H, C = 6, 10, 8, 3


def _batches(n: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)) for _ in range(n)]


class _Seen:
    """The probe's per-example norms at each step, as the monitor read them (its reads wrapped)."""

    def __init__(self, monkeypatch, module):
        self.norms: dict[int, dict[str, torch.Tensor]] = {}
        self.module = module
        read = PerExampleGradNorms.per_parameter

        def spy(probe):
            out = read(probe)
            self.norms[self.module.global_step] = {n: v.clone() for n, v in out.items()}
            return out

        monkeypatch.setattr(PerExampleGradNorms, "per_parameter", spy)


def _fit(module, batches, callbacks, steps):
    with tempfile.TemporaryDirectory() as root:  # the alerts file: each run its own folder
        pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=callbacks, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                   ).fit(module, torch.utils.data.DataLoader(batches, batch_size=None))


class _Oracle(pl.Callback):
    """Each example's own squared gradient norm per parameter, on a copy of the model at the batch's start."""

    def __init__(self, terms, twin=copy.deepcopy) -> None:
        self.terms, self.twin, self.norms = terms, twin, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        twin = self.twin(pl_module)
        losses = self.terms(twin, batch, trainer.global_step)
        params = {n: p for n, p in twin.named_parameters() if p.requires_grad}
        out = {n: [] for n in params}
        for j in range(losses.shape[0]):
            grads = torch.autograd.grad(losses[j], list(params.values()), retain_graph=True, allow_unused=True)
            for n, g in zip(params, grads):
                out[n].append(0.0 if g is None else float(g.pow(2).sum()))
        self.norms[trainer.global_step] = {n: torch.tensor(v) for n, v in out.items()}


def _exact(seen: _Seen, oracle: _Oracle, step: int, names) -> None:
    for name in names:
        # the monitor's loss is the batch mean: its per-example norms are those of each example's own loss term
        torch.testing.assert_close(seen.norms[step][name], oracle.norms[step][name], rtol=1e-4, atol=1e-9)


class _ByTerms(pl.LightningModule):
    """Trained on the mean of ``terms`` (each example's loss term, which the oracle differentiates one by one)."""

    def training_step(self, batch, batch_idx):
        return self.terms(self, batch, self.global_step).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Penalised(pl.LightningModule):
    """A classifier with an input-gradient penalty (``torch.autograd.grad(..., create_graph=True)``) from step
    ``start`` on."""

    def __init__(self, start: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.start = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C)), start

    def training_step(self, batch, batch_idx):
        x = batch[0].clone().requires_grad_(True)
        loss = F.cross_entropy(self.net(x), batch[1])
        if self.global_step >= self.start:
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            loss = loss + gx.pow(2).sum()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_gradient_penalty_switched_on_after_the_first_check_leaves_the_layers_out_not_the_fit():
    monitor = GradientNoiseScaleMonitor(every_n_steps=1)
    module = _Penalised(start=2)
    _fit(module, _batches(5), [monitor], 5)
    assert module.global_step == 5
    probe = monitor._probe
    assert sorted(probe.uncovered) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    assert all("more than one backward pass" in probe.reasons[n] for n in probe.uncovered)


class _TiedLater(_ByTerms):
    """An encoder with a classifier head and, from step 1 on, a reconstruction term decoding with the encoder's weight
    transposed (``F.linear(h, enc.weight.t())``, a tied decoder outside the encoder's module)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head = nn.Linear(D, H), nn.Linear(H, C)

    @staticmethod
    def terms(module, batch, step):
        x, y = batch
        h = torch.tanh(module.enc(x))
        t = F.cross_entropy(module.head(h), y, reduction="none")
        if step >= 1:
            t = t + (F.linear(h, module.enc.weight.t()) - x).pow(2).mean(1)
        return t


def test_a_weight_tied_outside_its_module_from_the_second_batch_on_is_found_at_the_next_verification(monkeypatch):
    # checks every step: the projections' check runs at the 1st, 2nd, 4th ... check; the tied use starts at the 2nd
    monitor, module = GradientNoiseScaleMonitor(every_n_steps=1), _TiedLater()
    seen, oracle = _Seen(monkeypatch, module), _Oracle(_TiedLater.terms)
    _fit(module, _batches(4), [oracle, monitor], 4)
    assert monitor._probe.uncovered == ["enc.weight"]
    assert "contributions the hooks did not see" in monitor._probe.reasons["enc.weight"]
    assert "enc.weight" in seen.norms[0] and all("enc.weight" not in seen.norms[s] for s in (1, 2, 3))
    for step in range(4):
        _exact(seen, oracle, step, ["enc.bias", "head.weight", "head.bias"] + (["enc.weight"] if step == 0 else []))


class _Pruned(_ByTerms):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C))

    @staticmethod
    def terms(module, batch, step):
        return F.cross_entropy(module.net(batch[0]), batch[1], reduction="none")


def test_weights_pruned_at_an_epochs_end_are_left_out_and_the_rest_stays_exact(monkeypatch):
    module = _Pruned()
    monitor = GradientNoiseScaleMonitor(every_n_steps=1)
    pruning = ModelPruning("l1_unstructured", amount=0.5, parameters_to_prune=[(module.net[0], "weight")],
                           use_global_unstructured=False, make_pruning_permanent=False, verbose=0)
    def twin(pruned):  # the same layers, unpruned, with the weights the pruned ones compute with
        plain = _Pruned()
        with torch.no_grad():
            for a, b in zip(plain.net, pruned.net):
                if isinstance(a, nn.Linear):
                    # the weight the layer computes with (its `weight` attribute is refreshed only at its next call)
                    a.weight.copy_(b.weight_orig * b.weight_mask if hasattr(b, "weight_mask") else b.weight)
                    a.bias.copy_(b.bias)
        return plain

    seen, oracle = _Seen(monkeypatch, module), _Oracle(_Pruned.terms, twin)
    _fit(module, _batches(4), [oracle, pruning, monitor], 8)  # epochs of 4 steps: pruned at each end
    assert hasattr(module.net[0], "weight_mask")
    # the pruning re-registers the parameter (`weight_orig`): the monitor builds its probe again at the next check, which
    # finds it pruned
    assert monitor._probe.uncovered == ["net.0.weight_orig"]
    assert "pruned (torch.nn.utils.prune" in monitor._probe.reasons["net.0.weight_orig"]
    # pruned after the first epoch (steps 0-3): measured before, left out from step 4, the rest exact throughout
    assert all("net.0.weight" in seen.norms[s] for s in range(4))
    assert all("net.0.weight" not in seen.norms[s] for s in range(4, 8))
    for step in range(8):
        _exact(seen, oracle, step, ["net.0.bias", "net.2.weight", "net.2.bias"] + (["net.0.weight"] if step < 4 else []))


def test_a_parameter_pruned_before_the_probe_is_built_is_left_out_as_pruned():
    net = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C))
    torch.nn.utils.prune.l1_unstructured(net[0], "weight", amount=0.5)
    probe = PerExampleGradNorms(net)
    assert "pruned (torch.nn.utils.prune" in probe.reasons["0.weight_orig"]


def test_a_weight_generated_by_a_hypernetwork_is_left_out_not_measured():
    class Hyper(nn.Module):
        def __init__(self):
            super().__init__()
            self.target = nn.Linear(D, C)  # its own weight is never used: a generated one takes its place
            self.code = nn.Parameter(torch.randn(4))
            self.gen = nn.Linear(4, C * D)

        def forward(self, x):
            weight = self.gen(self.code).reshape(C, D)
            return torch.func.functional_call(self.target, {"weight": weight, "bias": self.target.bias}, (x,))

    torch.manual_seed(0)
    net = Hyper()
    x, y = _batches(1)[0]
    with PerExampleGradNorms(net) as probe:
        F.cross_entropy(net(x), y).backward()
        norms = probe.per_parameter()
    assert "target.weight" not in norms and "target.weight" in probe.uncovered
    assert "another tensor in its place" in probe.reasons["target.weight"]
    # the layer's bias, used as itself, stays measured and exact
    oracle = torch.stack([torch.autograd.grad(F.cross_entropy(net(x[i:i + 1]), y[i:i + 1]), net.target.bias)[0]
                          .pow(2).sum() for i in range(B)])
    torch.testing.assert_close(norms["target.bias"], oracle, rtol=1e-4, atol=1e-10)


class _Widened(_ByTerms):
    """A hidden layer widened at step 3 (Net2Net: new, wider Linears; the optimizer rebuilt over the new parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(D, H), nn.Linear(H, C)

    @staticmethod
    def terms(module, batch, step):
        return F.cross_entropy(module.out(torch.tanh(module.inp(batch[0]))), batch[1], reduction="none")

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == 3 and self.inp.out_features == H:
            self.inp, self.out = nn.Linear(D, 2 * H), nn.Linear(2 * H, C)
            self.trainer.strategy.optimizers = [torch.optim.SGD(self.parameters(), lr=0.1)]


def test_a_layer_replaced_mid_run_is_measured_in_its_place(monkeypatch):
    # the probe kept the replaced layers' hooks and parameters: the new layers went unmeasured ("layers not called",
    # coverage 0 from the replacement on). The parameters' identities are compared at each check, as their flags are
    module = _Widened()
    monitor = GradientNoiseScaleMonitor(every_n_steps=1)
    seen, oracle = _Seen(monkeypatch, module), _Oracle(_Widened.terms)
    _fit(module, _batches(6), [oracle, monitor], 6)
    assert monitor._probe.uncovered == [] and all(monitor._probe._params[pid] is p for pid, p in
                                                  ((id(p), p) for p in module.parameters()))
    # the layers are replaced in the module's own batch-start hook, after the monitor's had armed the check of step 3:
    # that check measures nothing of them; from step 4 on, the new layers are measured, exactly
    for step in (0, 1, 2, 4, 5):
        _exact(seen, oracle, step, ["inp.weight", "inp.bias", "out.weight", "out.bias"])
    assert "inp.weight" not in seen.norms.get(3, {})


def test_spectral_alignment_watches_a_layer_replaced_mid_run():
    # SA kept the replaced layers: never called again, said as `layers_not_called`, the new (wider) ones unmeasured
    from lightning_monitor import SpectralAlignmentMonitor

    class Seen(pl.Callback):
        def __init__(self):
            self.sigma = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            value = trainer.callback_metrics.get("sa/inp/sigma")
            if value is not None:
                self.sigma[trainer.global_step] = float(value)

    module, seen = _Widened(), Seen()
    sa = SpectralAlignmentMonitor(every_n_steps=1, head=None)
    _fit(module, _batches(6), [sa, seen], 6)
    assert not [a for a in sa.hub.history if a.kind == "layers_not_called"]
    assert sa.layers["inp"] is module.inp and sa.layers["out"] is module.out
    # the sigma logged after the replacement is the new layer's top singular value
    torch.testing.assert_close(seen.sigma[6], float(torch.linalg.matrix_norm(module.inp.weight, ord=2)), rtol=1e-3,
                               atol=0)
