"""Spectral alignment on layers other than nn.Linear: Hugging Face Conv1D (its weight transposed) and
nn.Conv2d (its weight as [C_out, C_in*kh*kw] against input patches), against SVD / unfold oracles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_monitor import SpectralAlignmentMonitor
from lightning_monitor.probes.inputs import InputCapture
from lightning_monitor.selection import weight_matrix


def oracle_alignment(rows: torch.Tensor, w: torch.Tensor) -> tuple[float, torch.Tensor]:
    _, s, vh = torch.linalg.svd(w.detach().double())
    x = rows.double()
    return float(s[0]), (x @ vh[0]) / x.norm(dim=1)


def measured(mon: SpectralAlignmentMonitor, rows: dict[str, torch.Tensor], name: str):
    metrics, alignments = mon.measure(rows)
    return float(metrics[f"sa/{name}/sigma"]), alignments[name].double()


def test_hf_conv1d_is_its_transposed_weight() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    layer = Conv1D(6, 5)  # y = x @ W + b, W: [5 in, 6 out]
    assert torch.equal(weight_matrix(layer), layer.weight.t())
    x = torch.randn(3, 40, 5)
    assert torch.allclose(layer(x), x @ weight_matrix(layer).T + layer.bias, atol=1e-6)
    mon = SpectralAlignmentMonitor(n_iter=50)
    mon.layers = {"c": layer}
    sigma, a = measured(mon, {"c": x.reshape(-1, 5)}, "c")
    ref_sigma, ref_a = oracle_alignment(x.reshape(-1, 5), layer.weight.t())
    assert sigma == pytest.approx(ref_sigma, rel=1e-4)
    sign = 1.0 if float(a @ ref_a) > 0 else -1.0
    torch.testing.assert_close(a * sign, ref_a, atol=1e-4, rtol=0)
    # the monitor selects GPT-2's Conv1D projections, not its tied output head
    cfg = transformers.GPT2Config(vocab_size=31, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    names = SpectralAlignmentMonitor().select_layers(transformers.GPT2LMHeadModel(cfg))
    assert sorted(names) == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                             "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]


CONVS = {
    "plain": lambda: nn.Conv2d(3, 8, 3),
    "stride_pad": lambda: nn.Conv2d(3, 8, 3, stride=2, padding=1),
    "same_reflect": lambda: nn.Conv2d(3, 8, 3, padding="same", padding_mode="reflect"),
    "dilation": lambda: nn.Conv2d(3, 8, (3, 2), dilation=(2, 1)),
}


def independent_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """All input patches, built here without the library: (B * L, C * kh * kw)."""
    if conv.padding == "same":
        x = F.pad(x, [1, 1, 1, 1], mode=conv.padding_mode)
        pad = 0
    else:
        pad = conv.padding
    u = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=pad, stride=conv.stride)
    return u.transpose(1, 2).reshape(-1, u.shape[1])


@pytest.mark.parametrize("kind", list(CONVS))
def test_conv2d_rows_are_patches_and_alignment_matches_svd(kind: str) -> None:
    torch.manual_seed(0)
    conv = CONVS[kind]()
    x = torch.randn(6, 3, 9, 8)
    patches = independent_patches(conv, x)
    w = weight_matrix(conv)
    # the convolution is exactly W @ patch + b at every output position
    out = conv(x).flatten(2).transpose(1, 2).reshape(-1, conv.out_channels)
    torch.testing.assert_close(out, patches @ w.T + conv.bias, atol=1e-5, rtol=1e-5)
    cap = InputCapture({"c": conv}, max_rows=50, seed=1)
    cap.arm()
    conv(x)
    rows = cap.take()["c"]
    assert rows.shape == (50, 3 * conv.kernel_size[0] * conv.kernel_size[1])
    # every sampled row is one of the patches (distance to the nearest is 0)
    assert float(torch.cdist(rows, patches, compute_mode="donot_use_mm_for_euclid_dist").min(1).values.max()) < 1e-5
    mon = SpectralAlignmentMonitor(n_iter=50)
    mon.layers = {"c": conv}
    sigma, a = measured(mon, {"c": rows}, "c")
    ref_sigma, ref_a = oracle_alignment(rows, w)
    assert sigma == pytest.approx(ref_sigma, rel=1e-4)
    sign = 1.0 if float(a @ ref_a) > 0 else -1.0
    torch.testing.assert_close(a * sign, ref_a, atol=1e-4, rtol=0)


def test_conv2d_sampling_unfolds_only_the_examples_it_needs() -> None:
    conv = nn.Conv2d(3, 4, 3, padding=1)
    cap = InputCapture({"c": conv}, max_rows=100)
    x = torch.randn(64, 3, 16, 16)  # 256 patch positions per example: one example holds 100 rows
    calls = []
    import lightning_monitor.probes.per_example.conv as convmod

    original = convmod.unfold_input
    convmod.unfold_input = lambda m, t: calls.append(t.shape[0]) or original(m, t)
    try:
        rows = cap.sample_patches(conv, x)
    finally:
        convmod.unfold_input = original
    assert calls == [1] and rows.shape == (100, 27)


def test_grouped_conv_left_out() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 8, 1), nn.Flatten(), nn.Linear(8, 2))
    assert list(SpectralAlignmentMonitor().select_layers(model)) == ["1"]
