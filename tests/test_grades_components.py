"""GradES components beyond nn.Linear: GPT-2's Hugging Face Conv1D projections and the convolutions of a
ResNet's stages; what is not a component (stems, heads, norms, embeddings)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from lightning_monitor.functional.grades import find_components, mean_abs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def test_gpt2_conv1d_projections_are_components() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=31, n_positions=8, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    comps = find_components(model)
    assert sorted(comps) == sorted(
        f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    c = comps["transformer.h.0.attn.c_attn"]
    assert c.weight.shape == (16, 48) and len(c.params) == 2  # [in, out] layout, weight and bias frozen together


def test_conv1d_inside_a_numbered_block_under_any_name() -> None:
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    blocks = nn.ModuleList(nn.ModuleDict({"mix": Conv1D(4, 4), "ln": nn.LayerNorm(4)}) for _ in range(2))
    model = nn.ModuleDict({"blocks": blocks, "out": Conv1D(3, 4)})
    assert sorted(find_components(model)) == ["blocks.0.mix", "blocks.1.mix"]


def test_resnet_stage_convolutions_are_components() -> None:
    from coverage_table import ResNet

    model = ResNet()
    comps = find_components(model)
    expected = [f"layer{i}.{j}.conv{k}" for i in (1, 2) for j in (0, 1) for k in (1, 2)] + ["layer2.0.downsample.0"]
    assert sorted(comps) == sorted(expected)  # not the stem conv1, the BatchNorms nor the fc head
    # the statistic is the element-wise mean |gradient|, whatever the kernel's shape
    w = comps["layer1.0.conv1"].weight
    g = torch.randn_like(w)
    assert torch.allclose(mean_abs([g]), g.abs().mean().reshape(1))


def test_a_head_numbered_only_inside_its_own_sequential_is_not_a_component() -> None:
    # Hugging Face's ResNet head is `classifier = Sequential(Flatten(), Linear(...))`: its Linear is `classifier.1`,
    # numbered like a repeated block, and was a component (frozen with the blocks, counted in the frozen fraction)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    num_labels=4)
    model = transformers.ResNetForImageClassification(cfg)
    comps = find_components(model)
    assert "classifier.1" not in comps
    assert comps and all(".layers." in n or ".stages." in n for n in comps)
    # a Sequential of several layers of one kind stays a stack of numbered layers: each one a component
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    assert sorted(find_components(mlp)) == ["0", "2", "4"]
    head = nn.ModuleDict({"body": mlp, "out": nn.Sequential(nn.Flatten(), nn.Linear(3, 2))})
    assert sorted(find_components(head)) == ["body.0", "body.2", "body.4"]


def test_nothing_found_can_be_asked_without_raising() -> None:
    model = nn.Sequential()
    model.add_module("emb", nn.Embedding(5, 4))
    assert find_components(model, allow_empty=True) == {}
    with pytest.raises(ValueError, match="no trainable component"):
        find_components(model)


class _BareLoRA(nn.Module):
    """A frozen base projection with LoRA factors held as bare parameters of the module (`q_proj.lora_A`)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.q_proj.weight.requires_grad_(False)
        self.q_proj.lora_A = nn.Parameter(torch.zeros(2, 8))
        self.q_proj.lora_B = nn.Parameter(torch.zeros(8, 2))


class _BareLoRAStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_BareLoRA() for _ in range(2))


def test_bare_lora_parameters_are_selected_by_their_own_names() -> None:
    # found by the naming scheme, but `include` / `exclude` checked patterns against module names only: the names the
    # monitor reports for them were refused ("matches no module") or matched only the frozen base
    model = _BareLoRAStack()
    names = [f"layers.{i}.q_proj.lora_{x}" for i in range(2) for x in "AB"]
    assert list(find_components(model, trainable_only=True)) == names
    assert list(find_components(model, include=["*lora_A"], trainable_only=True)) == names[0::2]
    assert list(find_components(model, include=[names[1]], trainable_only=True)) == [names[1]]
    assert list(find_components(model, exclude=["*lora_B"], trainable_only=True)) == names[0::2]
    assert list(find_components(model, exclude=["layers.1.q_proj"], trainable_only=True)) == names[:2]
    with pytest.raises(ValueError, match="matches no module"):
        find_components(model, include=["*lora_C"])


def test_a_classifier_head_of_several_layers_is_not_a_component() -> None:
    # MobileNetV3's and MaxViT's heads are `classifier = Sequential(Linear, Hardswish, Dropout, Linear)`: two Linears of
    # one kind, numbered like a stack of blocks, were both components (the classifier GWA scores could be frozen)
    features = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()))
    model = nn.ModuleDict({"features": features, "pool": nn.AdaptiveAvgPool2d(1),
                           "classifier": nn.Sequential(nn.Linear(4, 8), nn.Hardswish(), nn.Dropout(), nn.Linear(8, 3))})
    assert sorted(find_components(model)) == ["features.0.0", "features.1.0"]
    # a model that is one Sequential of layers (wrapped or not) keeps each of them
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    assert sorted(find_components(nn.ModuleDict({"net": mlp}))) == ["net.0", "net.2", "net.4"]


def _tiny_moe(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=37, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=16, intermediate_size=32, num_experts_per_tok=2)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **common))
    elif not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no GptOssForCausalLM")
    else:
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(num_local_experts=4, head_dim=8, **common))
    # what is under test is the fused `[E, out, in]` expert tensors: older transformers (4.x) build Mixtral's experts
    # as one module of Linears per expert (`block_sparse_moe.experts.0.w1`), which are plain Linear components
    if not any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters()):
        pytest.skip(f"transformers {transformers.__version__}'s {type(model).__name__} has no fused expert tensors "
                    "(`mlp.experts.gate_up_proj`): one module per expert")
    return model


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_fused_expert_tensors_are_components_frozen_with_their_bias(kind: str) -> None:
    """A mixture of experts' fused ``[E, out, in]`` expert tensors: one component each (over all experts), with the
    bias of the same name when there is one (GPT-OSS); the router is none."""
    model = _tiny_moe(kind)
    comps = find_components(model)
    experts = {n for n in comps if ".experts." in n}
    assert experts == {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")}
    for name in experts:
        module, _, pname = name.rpartition(".")
        holder = model.get_submodule(module)
        assert comps[name].weight is getattr(holder, pname) and comps[name].weight.dim() == 3
        bias = getattr(holder, pname + "_bias", None)
        assert comps[name].params == ((comps[name].weight,) if bias is None else (comps[name].weight, bias))
    assert not any("router" in n or n.endswith("mlp.gate") for n in comps)


def test_stacked_2d_expert_tensors_are_components() -> None:
    """DBRX keeps its experts stacked in 2-D (``ffn.experts.mlp.w1`` / ``v1`` / ``w2``, ``[E * I, H]``): one
    component each. Before, the router's Linear was watched and the experts were only named as matrices no
    component holds, so "all frozen" left them training."""
    transformers = pytest.importorskip("transformers")
    from lightning_monitor.functional.grades import uncovered_matrices

    config = transformers.DbrxConfig(
        vocab_size=37, d_model=16, n_heads=2, n_layers=2, max_seq_len=16,
        attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2))
    model = transformers.DbrxForCausalLM(config)
    comps = find_components(model)
    stacked = [f"transformer.blocks.{i}.ffn.experts.mlp.{p}" for i in (0, 1) for p in ("w1", "v1", "w2")]
    assert set(stacked) <= set(comps)
    assert all(comps[n].weight is model.get_parameter(n) and comps[n].weight.dim() == 2 for n in stacked)
    assert uncovered_matrices(model, comps) == []
    # a 2-D parameter of an expert name outside a module named `experts` is no expert tensor
    plain = nn.Module()
    plain.blocks = nn.ModuleList([nn.Module()])
    plain.blocks[0].w1 = nn.Parameter(torch.zeros(4, 4))
    plain.blocks[0].lin = nn.Linear(4, 4)
    assert list(find_components(plain)) == ["blocks.0.lin"]


def test_frozen_expert_tensors_stay_frozen_in_fit(tmp_path) -> None:
    """GradES freezes the fused expert tensors of a tiny Mixtral in ``Trainer.fit``: the run goes on, and their
    values no longer move."""
    import lightning.pytorch as pl

    from lightning_monitor import GradientEarlyStopping

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _tiny_moe("mixtral")

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    lm = LM()
    names = [f"model.model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")]
    grades = GradientEarlyStopping(include=names, tau=1e6, grace_steps=2, every_n_steps=1, stop=False)
    data = torch.utils.data.TensorDataset(torch.randint(0, 37, (64, 8)))
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[grades],
                         default_root_dir=str(tmp_path))
    params = dict(lm.named_parameters())
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Values(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen[trainer.global_step] = {n: params[n].detach().clone() for n in names}

    trainer.callbacks.append(Values())
    trainer.fit(lm, torch.utils.data.DataLoader(data, batch_size=8))
    assert set(grades.frozen) == set(names) and trainer.global_step == 8
    frozen_at = grades.frozen[names[0]]
    assert frozen_at < 7 and all(not params[n].requires_grad for n in names)
    assert not torch.equal(seen[0][names[0]], seen[frozen_at][names[0]])  # they trained before ...
    for n in names:  # ... and not after (the freezing step's own update included)
        assert torch.equal(seen[frozen_at + 1][n], params[n].detach())


def test_towers_are_components_not_an_output_head() -> None:
    """The container of the last matrix layer is an output head only when nothing else in the model is a container of
    its kind holding such layers: a dual encoder's second tower and an autoencoder's decoder are judged too (with only
    the first tower judged, the run stopped while the other was still learning)."""

    class Tower(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(i, 8), nn.Linear(8, 4)])

    dual = nn.ModuleDict({"img": Tower(6), "txt": Tower(5)})
    assert sorted(find_components(dual)) == ["img.layers.0", "img.layers.1", "txt.layers.0", "txt.layers.1"]
    ae = nn.ModuleDict({"encoder": nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)),
                        "decoder": nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 8))})
    assert sorted(find_components(ae)) == ["decoder.0", "decoder.2", "encoder.0", "encoder.2"]
    encdec = nn.ModuleDict({"encoder": nn.ModuleList([nn.Linear(4, 4) for _ in range(2)]),
                            "decoder": nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])})
    assert sorted(find_components(encdec)) == ["decoder.0", "decoder.1", "encoder.0", "encoder.1"]


def test_dual_encoder_fit_judges_both_towers(tmp_path) -> None:
    """In a fit, GradES stops a CLIP-style run only once both towers' layers are frozen."""
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_monitor import GradientEarlyStopping

    class Clip(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.img = nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(6, 16), nn.Linear(16, 8)])})
            self.txt = nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(5, 16), nn.Linear(16, 8)])})

        def tower(self, t: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return F.normalize(t["layers"][1](torch.relu(t["layers"][0](x))), dim=-1)

        def training_step(self, batch, _):
            a, b = batch
            logits = 10 * self.tower(self.img, a) @ self.tower(self.txt, b).T
            return F.cross_entropy(logits, torch.arange(a.shape[0]))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    torch.manual_seed(0)
    z = torch.randn(256, 4)
    data = TensorDataset(torch.cat([z, z[:, :2] ** 2], 1), torch.cat([z, z[:, :1].sin()], 1))
    grades = GradientEarlyStopping(grace_steps=10, tau=0.9)
    trainer = pl.Trainer(max_steps=200, accelerator="cpu", logger=False, callbacks=[grades], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(Clip(), DataLoader(data, batch_size=16, shuffle=True, drop_last=True))
    assert sorted(grades.components) == ["img.layers.0", "img.layers.1", "txt.layers.0", "txt.layers.1"]
    assert grades.stopped_at is not None
    # the stop came with every layer of both towers converged (the last one held trainable: nothing else is left)
    assert sorted([*grades.frozen, *grades.held]) == sorted(grades.components)
    assert any(n.startswith("txt.") for n in grades.frozen) and any(n.startswith("img.") for n in grades.frozen)


@pytest.mark.parametrize("kind", ["orthogonal", "weight_norm", "custom"])
def test_parametrized_layers_are_components_frozen_through_their_originals(kind: str) -> None:
    """``torch.nn.utils.parametrize`` gives each module a class of its own and computes ``weight`` from trainable
    originals: the blocks are still components (they were none: the preset's GradES went idle), judged on the largest
    original's gradient, and freezing one freezes every original and the bias."""
    from torch.nn.utils import parametrizations, parametrize

    from lightning_monitor.functional.grades import freeze_parameters

    class Symmetric(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w.triu() + w.triu(1).transpose(-1, -2)

    blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
    for block in blocks:
        if kind == "orthogonal":
            parametrizations.orthogonal(block)
        elif kind == "weight_norm":
            parametrizations.weight_norm(block)
        else:
            parametrize.register_parametrization(block, "weight", Symmetric())
    model = nn.ModuleDict({"blocks": blocks, "head": nn.Linear(6, 2)})
    comps = find_components(model)
    assert sorted(comps) == ["blocks.0", "blocks.1", "blocks.2"]
    originals = list(blocks[1].parametrizations.weight.parameters())
    comp = comps["blocks.1"]
    assert comp.weight is max(originals, key=lambda p: p.numel())
    assert {id(p) for p in comp.params} == {id(p) for p in originals} | {id(blocks[1].bias)}
    torch.nn.functional.mse_loss(model["head"](torch.tanh(blocks[1](torch.randn(4, 6)))), torch.zeros(4, 2)).backward()
    assert comp.weight.grad is not None  # the statistic's gradient
    freeze_parameters(comp.params)
    assert not any(p.requires_grad for p in originals) and not blocks[1].bias.requires_grad
    assert blocks[0].bias.requires_grad


def test_bare_attention_projections_are_components_and_freeze_in_fit(tmp_path) -> None:
    """XLNet holds its attention projections as bare parameters (``rel_attn.q`` ``[d_model, heads, d_head]``, and
    ``k``, ``v``, ``o``, ``r``): each is a component. Before, only the feed-forward Linears were, and GradES stopped a
    run "all frozen" while the attention, never watched, still trained."""
    transformers = pytest.importorskip("transformers")
    import lightning.pytorch as pl

    from lightning_monitor import GradientEarlyStopping

    config = transformers.XLNetConfig(vocab_size=37, d_model=32, n_layer=2, n_head=2, d_inner=64, dropout=0.0)
    found = find_components(transformers.XLNetLMHeadModel(config))
    bare = [f"transformer.layer.{i}.rel_attn.{p}" for i in (0, 1) for p in ("q", "k", "v", "o", "r")]
    assert set(bare) <= set(found) and len(found) == 14  # and the two feed-forward Linears a layer
    assert all(found[n].params == (found[n].weight,) for n in bare)  # r_w_bias & co. are not frozen with them

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.XLNetLMHeadModel(config)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    lm = LM()
    grades = GradientEarlyStopping(tau=1e6, grace_steps=2, every_n_steps=1, stop=False)  # every component freezes
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[grades],
                         default_root_dir=str(tmp_path))
    trainer.fit(lm, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 37, (48, 8))),
                                                batch_size=8))
    params = dict(lm.named_parameters())
    assert {f"model.{n}" for n in bare} <= set(grades.frozen)
    assert not any(params[f"model.{n}"].requires_grad for n in bare)
    assert params["model.transformer.layer.0.rel_attn.r_w_bias"].requires_grad


def test_matrices_no_component_holds_are_said(tmp_path) -> None:
    """Mamba's ``A_log`` (``[d_inner, d_state]`` in each mixer) is no attention or MLP matrix: not a component, and
    said once, since it keeps training while the components freeze."""
    transformers = pytest.importorskip("transformers")
    import lightning.pytorch as pl

    from lightning_monitor import GradientEarlyStopping, read_alerts
    from lightning.pytorch.loggers import CSVLogger

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.MambaForCausalLM(transformers.MambaConfig(
                vocab_size=37, hidden_size=32, num_hidden_layers=2, state_size=8))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    logger = CSVLogger(str(tmp_path), name="mamba")
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GradientEarlyStopping(grace_steps=1, every_n_steps=1)])
    trainer.fit(LM(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 37, (24, 8))),
                                                  batch_size=8))
    said = [a for a in read_alerts(os.path.join(logger.log_dir, "alerts.jsonl")) if a.kind == "matrices_not_watched"]
    assert len(said) == 1 and said[0].value == 2.0
    assert "model.backbone.layers.0.mixer.A_log" in said[0].message and "stop=False" in said[0].message
