"""Parameters upstream of a BatchNorm that normalises with its batch's statistics: the statistics couple the
examples, so an example's gradient there is not that of its own loss. The probe leaves them out with the reason
(found on the autograd graph); what lies downstream stays covered and exact against each example's own loss; a
BatchNorm in eval mode (running statistics) couples nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_per_example import check
from torch import nn

from lightning_monitor import PerExampleGradNorms

B = 8


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(1, 8, 5, padding=2), nn.BatchNorm1d(8), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
                         nn.Flatten(), nn.Linear(8, 3))


def _own_loss_grads(net: nn.Module, x: torch.Tensor, y: torch.Tensor, name: str) -> torch.Tensor:
    """Each example's squared gradient norm of its own loss (times B: the mean's scale), in the batch's forward."""
    p = dict(net.named_parameters())[name]
    per = F.cross_entropy(net(x), y, reduction="none") * 1.0
    return torch.stack([torch.autograd.grad(per[i], p, retain_graph=True)[0].pow(2).sum() for i in range(x.shape[0])])


def test_parameters_upstream_of_a_training_batchnorm_are_left_out_with_the_reason() -> None:
    net = _net()
    x, y = torch.randn(B, 1, 64), torch.randint(0, 3, (B,))
    probe = PerExampleGradNorms(net)
    with probe:
        F.cross_entropy(net(x), y).backward()
    per = probe.per_parameter()
    assert set(probe.uncovered) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert "'1'" in probe.reasons["0.bias"] and "BatchNorm" in probe.reasons["0.bias"]
    # the conv bias: exactly zero in each example's own loss (the batch mean removes it), so nothing to separate
    assert float(_own_loss_grads(net, x, y, "0.bias").max()) < 1e-12
    # downstream of it, the head: covered, and each example's own loss's gradient
    assert set(per) == {"5.weight", "5.bias"}
    for name in per:
        torch.testing.assert_close(per[name], _own_loss_grads(net, x, y, name), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("dims", [1, 2])
def test_a_batchnorm_in_eval_mode_couples_nothing_and_is_measured(dims: int) -> None:
    # running statistics: each example normalised on its own, an affine map per channel; its own weight and bias
    # were left out by rule (1-7% of the squared norm of a MobileNetV2 fine-tuned with its BatchNorms in eval)
    net = _net() if dims == 1 else nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 3))
    with torch.no_grad():  # statistics and affine parameters away from their initial 0 / 1
        net[1].running_mean.normal_(0, 0.3)
        net[1].running_var.uniform_(0.5, 2.0)
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.normal_(0, 0.1)
    net[1].eval()
    x = torch.randn(B, 1, 64) if dims == 1 else torch.randn(B, 1, 8, 8)
    probe = check(net, F.cross_entropy, x, torch.randint(0, 3, (B,)))  # against each example's own backward
    assert not probe.uncovered
    assert {"0.weight", "0.bias", "1.weight", "1.bias", "5.weight"} <= set(probe.covered)
    net[1].train()  # the same layer in training mode: refused, with the reason
    probe = PerExampleGradNorms(net)
    with probe:
        F.cross_entropy(net(x), torch.randint(0, 3, (B,))).backward()
    assert {"1.weight", "1.bias"} <= set(probe.uncovered) and "batch statistics" in probe.reasons["1.weight"]


def test_the_coupling_is_found_once_and_kept_across_steps() -> None:
    net = _net()
    probe = PerExampleGradNorms(net)
    for step in range(2):
        with probe:
            walks = [h for h in net[1]._forward_pre_hooks.values() if getattr(h, "__name__", "") == "_coupling_hook"]
            assert len(walks) == (1 if step == 0 else 0)  # no walking hook once walked
            F.cross_entropy(net(torch.randn(B, 1, 64)), torch.randint(0, 3, (B,))).backward()
        assert {"0.weight", "0.bias"} <= set(probe.uncovered)
        probe.reset()
        net.zero_grad()
    assert probe._coupling_walked == {id(net[1])}  # walked at the first step only


class _Coupled(nn.Module):
    """Linear -> (a coupling of the examples that is not a BatchNorm module, or none) -> tanh -> Linear."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.a, self.b = kind, nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.kind == "functional":
            h = F.batch_norm(h, None, None, training=True)
        elif self.kind == "centred":
            h = h - h.mean(0, keepdim=True)
        elif self.kind == "layer_norm":  # each example on its own: couples nothing
            h = F.layer_norm(h, (8,))
        out = self.b(torch.tanh(h))
        if self.kind == "masked":  # a class never allowed, masked with -inf: couples nothing either
            out = out.masked_fill(torch.arange(3) == 2, float("-inf"))
        if self.kind == "centred_output":
            out = out - out.mean(0, keepdim=True)
        return out


@pytest.mark.parametrize("kind", ["functional", "centred", "centred_output", "layer_norm", "masked"])
def test_examples_coupled_outside_a_batchnorm_module_are_found_by_running_a_slice(kind: str) -> None:
    # functional batch norm or a batch-centred activation: the parts each example's rows give still add up to the batch
    # gradient, so the probe's own check passed, and the norms of `a` were off by up to 7.8x with full coverage (the
    # noise scale's g2 12-24% off, changing sign); now the first examples run alone in eval mode show the coupling
    net = _Coupled(kind)
    x, y = torch.randn(B, 5), torch.randint(0, 2 if kind == "masked" else 3, (B,))
    probe = PerExampleGradNorms(net)
    with probe:
        F.cross_entropy(net(x), y).backward()
    per = probe.per_parameter()
    left_out = {"a.weight", "a.bias"} | ({"b.weight", "b.bias"} if kind == "centred_output" else set())
    if kind in ("layer_norm", "masked"):  # (the masked logits' infinities were read as a coupling at first)
        left_out = set()
    assert set(probe.uncovered) == left_out
    assert all("coupled" in probe.reasons[n] for n in left_out)
    for name in per:  # what stays covered is each example's own loss's gradient
        torch.testing.assert_close(per[name], _own_loss_grads(net, x, y, name), rtol=1e-4, atol=1e-9)
