"""A model whose layers are built in ``LightningModule.configure_model``, which Lightning calls after the callbacks'
``setup``: the monitors select what to watch once it exists (every monitor said it had nothing to watch, and stayed
idle for the whole fit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tb_scalars
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

import lightning_monitor as lm


class _Built(LightningModule):
    """Blocks of Linear layers and a classifier, made in ``configure_model`` (once); ``classes=0``: a regression."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.classes = classes
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
            self.net = nn.ModuleDict({"blocks": blocks, "head": nn.Linear(8, max(self.classes, 1))})

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.net["blocks"]:
            x = x + block(x)
        out = self.net["head"](x)
        return F.cross_entropy(out, y) if self.classes else F.mse_loss(out.squeeze(1), y.float())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=32)


def _fit(tmp_path, callbacks, model, steps=24) -> Trainer:
    trainer = Trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
                      logger=TensorBoardLogger(str(tmp_path), name="run", version=""))
    trainer.fit(model, _loader())
    return trainer


def test_preset_watches_a_model_built_in_configure_model(tmp_path) -> None:
    hm = lm.HealthMonitor(grades=dict(grace_steps=4, every_n_steps=2, stop=False),
                          spectral=dict(every_n_steps=4), noise_scale=dict(every_n_steps=4))
    trainer = _fit(tmp_path, [hm], _Built())
    monitors = {m.name: m for m in hm.monitors}
    assert {name: m.idle_reason for name, m in monitors.items()} == dict.fromkeys(monitors)
    assert not [a for a in hm.guard.hub.history if a.kind == "nothing_to_watch"]
    assert len(hm.grades._components) == 2 and hm.gwa._head_name == "net.head"
    scalars = tb_scalars(str(tmp_path / "run"))
    assert any(tag.startswith("sa/") for tag in scalars) and "gns/b_simple" in scalars and "gwa/score" in scalars
    assert trainer.global_step == 24


def test_monitor_alone_selects_at_the_start_of_the_fit_and_still_says_what_it_cannot_watch(tmp_path) -> None:
    """A monitor passed alone selects in its own ``on_fit_start``; a model that, once built, offers it nothing (GWA
    on a regression) is still said to have nothing to watch, once."""
    sa = lm.SpectralAlignmentMonitor(every_n_steps=4)
    gwa = lm.GradientWeightAlignmentMonitor()
    gwa.idle_when_nothing_to_watch = True
    _fit(tmp_path, [sa, gwa], _Built(classes=0), steps=8)
    assert sa.idle_reason is None
    assert [step for step, _ in tb_scalars(str(tmp_path / "run"))["sa/sign_diversity_mean"]] == [0, 4]
    assert gwa.idle_reason is not None
    assert [a.kind for a in gwa.hub.history if a.monitor == "gwa"].count("nothing_to_watch") == 1


def test_a_model_with_no_configure_model_still_fails_at_setup() -> None:
    """Without a ``configure_model`` nothing is built later: a monitor given nothing to watch says so at setup."""

    class Empty(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            return (self.scale * batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(lm.NothingToWatch, match="nn.Linear"):
        Trainer(accelerator="cpu", max_steps=1, callbacks=[lm.SpectralAlignmentMonitor()], logger=False,
                enable_progress_bar=False).fit(Empty(), _loader())


class _Adapted(nn.Module):
    """A low-rank adapter around a frozen Linear (LoRA's shape), put in by ``configure_model``."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


class _AdaptedNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.ModuleDict({"q_proj": nn.Linear(16, 16), "up_proj": nn.Linear(16, 32),
                                                   "down_proj": nn.Linear(32, 16)}) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def configure_model(self) -> None:  # idempotent, as Lightning asks
        for block in self.blocks:
            if not isinstance(block["up_proj"], _Adapted):
                block["up_proj"] = _Adapted(block["up_proj"])

    def training_step(self, batch, batch_idx):
        h = self.emb(batch[0])
        for b in self.blocks:
            h = h + torch.tanh(b["q_proj"](h))
            h = h + b["down_proj"](F.gelu(b["up_proj"](h)))
        return F.cross_entropy(self.head(h), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3)


def test_grades_resumes_a_model_whose_configure_model_wraps_layers(tmp_path) -> None:
    """Adapters put in by ``configure_model``: GradES selects again at the start of the fit and watches them; the
    resume from its checkpoint failed ("written for other components") when the saved names were checked against
    the components of setup, before the adapters. It resumes with the frozen set it saved, frozen."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    loader = DataLoader(TensorDataset(x, (x @ torch.randn(8, 4, generator=g)).argmax(-1)), batch_size=16)

    def grades():  # every component freezes at the first decision past the grace period
        return lm.GradientEarlyStopping(tau=1e9, threshold="absolute", grace_steps=2, every_n_steps=2, smoothing=0.0,
                                        stop=False, min_loss_progress=None)

    first, ckpt = grades(), ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=8, save_top_k=-1,
                                            filename="{step}")
    Trainer(max_steps=8, accelerator="cpu", logger=False, callbacks=[first, ckpt], enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=str(tmp_path)).fit(_AdaptedNet(), loader)
    assert any("lora_A" in c for c in first.components) and first.frozen
    resumed, model = grades(), _AdaptedNet()
    Trainer(max_steps=12, accelerator="cpu", logger=False, callbacks=[resumed], enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path)).fit(
        model, loader, ckpt_path=str(tmp_path / "step=8.ckpt"))
    assert resumed.components == first.components and set(resumed.frozen) == set(first.frozen)
    modules = dict(model.named_modules())
    assert all(not p.requires_grad for name in resumed.frozen for p in modules[name].parameters())


class _BlockWithMatrix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.up_proj, self.down_proj = nn.Linear(16, 16), nn.Linear(16, 32), nn.Linear(32, 16)
        self.A_log = nn.Parameter(torch.zeros(16, 16))  # a trainable matrix no component holds (a state space's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.q_proj(x)) + x @ self.A_log
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class _RemadeHead(LightningModule):
    """A head of 10 classes re-made for the task's 4 in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Linear(8, 16), nn.Linear(16, 10)
        self.blocks = nn.ModuleList(_BlockWithMatrix() for _ in range(2))

    def configure_model(self) -> None:
        if self.head.out_features != 4:
            self.head = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        h = self.emb(batch[0])
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def test_selecting_again_at_the_start_of_the_fit_says_the_setup_alerts_once(tmp_path) -> None:
    """The monitors select again where ``configure_model`` replaced modules: GradES's one-off notes of its selection
    (`matrices_not_watched`: a matrix no component holds) were said at setup and again at the start of the fit."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    grades = lm.GradientEarlyStopping(grace_steps=4, every_n_steps=2, stop=False)
    Trainer(max_steps=4, accelerator="cpu", logger=False, callbacks=[grades], enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path)).fit(
        _RemadeHead(), DataLoader(TensorDataset(x, torch.randint(0, 4, (64,), generator=g)), batch_size=16))
    assert [a.kind for a in grades.hub.history].count("matrices_not_watched") == 1
