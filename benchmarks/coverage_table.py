"""What each monitor covers on the model families people train: a tiny random-init model of each family
is trained a few steps in ``Trainer.fit`` with every monitor on, and the table (model family x monitor:
covered / partial with the share / not applicable with the reason) is written from what the monitors
report, to ``docs/model_coverage.md``.

Run ``python benchmarks/coverage_table.py`` (CPU, about half a minute; nothing is downloaded: the
Hugging Face models are built from small configs). ``tests/test_model_zoo.py`` trains the same zoo
(:func:`zoo`, :func:`fit_zoo_model`) and checks every logged value.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from lightning_monitor import (  # noqa: E402
    DivergenceGuard,
    GradientEarlyStopping,
    GradientNoiseScaleMonitor,
    GradientWeightAlignmentMonitor,
    SpectralAlignmentMonitor,
    read_alerts,
)
from lightning_monitor.callbacks.base import Monitor  # noqa: E402

BATCH, STEPS, EVERY, N = 8, 4, 2, 32
VOCAB, T = 50, 12


# ----------------------------------------------------------------------------- data


class Items(Dataset):
    """``n`` items made by ``make(i)`` (a tensor tuple or a dict of tensors), deterministic."""

    def __init__(self, make: Callable[[torch.Generator], Any], n: int = N) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [make(g) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def _tokens(g: torch.Generator) -> dict[str, Tensor]:
    ids = torch.randint(0, VOCAB, (T,), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _classified_tokens(g: torch.Generator) -> dict[str, Tensor]:
    ids = torch.randint(1, VOCAB, (T,), generator=g)
    mask = torch.ones(T, dtype=torch.long)
    mask[int(torch.randint(T // 2, T + 1, (1,), generator=g)):] = 0
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.randint(0, 3, (), generator=g)}


def _images_dict(g: torch.Generator) -> dict[str, Tensor]:
    return {"pixel_values": torch.randn(3, 16, 16, generator=g), "labels": torch.randint(0, 3, (), generator=g)}


def _images(g: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(3, 16, 16, generator=g), torch.randint(0, 3, (), generator=g)


def _vectors(g: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(10, generator=g), torch.randint(0, 3, (), generator=g)


def _sequences(g: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randint(0, VOCAB, (T,), generator=g), torch.randint(0, 3, (), generator=g)


# ----------------------------------------------------------------------------- models


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else None
        )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """A torchvision-style ResNet (stem, two stages of BasicBlocks with BatchNorm, pooled fc head)."""

    def __init__(self, classes: int = 3, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, width, 1))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width, 1))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(x.mean((2, 3)))


class MHAClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.ffn = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        h = self.norm(h + self.mha(h, h, h, need_weights=False)[0])
        h = h + F.gelu(self.ffn(h))
        return self.head(h.mean(1))


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, idx: Tensor) -> Tensor:
        out, _ = self.lstm(self.emb(idx))
        return self.head(out[:, -1])


def _hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**batch).loss


def _ce_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _gpt2() -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _bert() -> nn.Module:
    import transformers

    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=T, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def _vit() -> nn.Module:
    import transformers

    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32, num_labels=3)
    return transformers.ViTForImageClassification(cfg)


def _opt() -> nn.Module:
    import transformers

    # OPT's learned positions subclass nn.Embedding with a forward of their own (they take the attention mask)
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                 ffn_dim=32, max_position_embeddings=T, word_embed_proj_dim=16)
    return transformers.OPTForCausalLM(cfg)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


@dataclass
class ZooEntry:
    """One model family: how to build the model, its loss on a batch and its data."""

    family: str
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Any], Tensor]
    item: Callable[[torch.Generator], Any]
    hf: bool = False


def zoo() -> list[ZooEntry]:
    """The model families, smallest configs that still have each family's structure."""
    return [
        ZooEntry("HF GPT-2 (GPT2LMHeadModel)", _gpt2, _hf_loss, _tokens, hf=True),
        ZooEntry("HF Llama (LlamaForCausalLM)", _llama, _hf_loss, _tokens, hf=True),
        ZooEntry("HF OPT (OPTForCausalLM)", _opt, _hf_loss, _tokens, hf=True),
        ZooEntry("HF BERT (BertForSequenceClassification)", _bert, _hf_loss, _classified_tokens, hf=True),
        ZooEntry("HF ViT (ViTForImageClassification)", _vit, _hf_loss, _images_dict, hf=True),
        ZooEntry("ResNet (BatchNorm, torchvision-style)", ResNet, _ce_loss, _images),
        ZooEntry("MLP", _mlp, _ce_loss, _vectors),
        ZooEntry("nn.MultiheadAttention classifier", MHAClassifier, _ce_loss, _sequences),
        ZooEntry("LSTM classifier", LSTMClassifier, _ce_loss, _sequences),
    ]


class ZooModule(pl.LightningModule):
    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Any], Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss_fn(self.model, batch)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# ----------------------------------------------------------------------------- one fit


def monitors(snapshot_dir: str) -> dict[str, Monitor]:
    """Every monitor, on a short cadence, idle (one warning alert) when the model offers it nothing."""
    out: dict[str, Monitor] = {
        "SpectralAlignment": SpectralAlignmentMonitor(every_n_steps=EVERY, baseline_checks=1),
        "GradientNoiseScale": GradientNoiseScaleMonitor(every_n_steps=EVERY),
        "GradientWeightAlignment": GradientWeightAlignmentMonitor(warmup_epochs=0, suspects=0),
        "GradientEarlyStopping": GradientEarlyStopping(every_n_steps=EVERY, grace_steps=0, stop=False),
        "DivergenceGuard": DivergenceGuard(every_n_steps=EVERY, snapshot_dir=snapshot_dir),
    }
    for mon in out.values():
        mon.idle_when_nothing_to_watch = True
    return out


@dataclass
class ZooRun:
    family: str
    monitors: dict[str, Monitor]
    scalars: dict[str, list[tuple[int, float]]]
    alerts: list[Any]
    seconds: float
    log_dir: str
    error: Optional[BaseException] = None
    extra: dict[str, Any] = field(default_factory=dict)


def fit_zoo_model(entry: ZooEntry, root: str) -> ZooRun:
    """Train ``entry`` for ``STEPS`` steps with every monitor and a TensorBoard logger; read back what was
    logged (every scalar) and the alerts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pl.seed_everything(0, verbose=False)
    module = ZooModule(entry.make(), entry.loss)
    mons = monitors(os.path.join(root, "snapshots"))
    logger = TensorBoardLogger(root, name="tb")
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=STEPS, logger=logger, callbacks=list(mons.values()), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    start = time.perf_counter()
    trainer.fit(module, DataLoader(Items(entry.item), batch_size=BATCH))
    seconds = time.perf_counter() - start
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    path = os.path.join(logger.log_dir, "alerts.jsonl")
    alerts = read_alerts(path) if os.path.exists(path) else []
    return ZooRun(entry.family, mons, scalars, alerts, seconds, logger.log_dir)


# ----------------------------------------------------------------------------- the table


def _short(text: str, limit: int = 140) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def uncovered_modules(mon: GradientNoiseScaleMonitor) -> dict[str, str]:
    """Module -> why its parameters are left out of the per-example norms (the probe's reasons)."""
    probe = mon._probe
    if probe is None:
        return {}
    out: dict[str, str] = {}
    for p in probe.uncovered:
        out.setdefault(p.rsplit(".", 1)[0], probe.reasons.get(p, ""))
    return out


def _reason_summary(reason: str) -> str:
    """The reason up to its first parenthesis or colon: what, not the details."""
    if reason.startswith("no handler"):
        return reason
    for stop in (" (", ": ", ", so "):
        cut = reason.find(stop, 12)
        if cut > 0:
            reason = reason[:cut]
    return reason


def _coverage_cell(run: ZooRun) -> str:
    mon = run.monitors["GradientNoiseScale"]
    values = [v for _, v in run.scalars.get("gns/coverage", [])]
    if not values:
        return "no check ran"
    share = min(values)
    if share >= 1.0 - 1e-9:
        return "covered: per-example norms of every parameter"
    by_reason: dict[str, list[str]] = {}
    for module, reason in uncovered_modules(mon).items():
        by_reason.setdefault(_reason_summary(reason), []).append(module.removeprefix("model."))
    parts = [f"{', '.join(mods[:2])}{f' +{len(mods) - 2}' if len(mods) > 2 else ''}: {why}"
             for why, mods in by_reason.items()]
    label = "partial" if share < mon.min_coverage else "covered"
    return f"{label}: {share:.1%} of the gradient's squared norm; left out: {'; '.join(parts)}"


def _cell(run: ZooRun, name: str) -> str:
    mon = run.monitors[name]
    if mon.idle_reason is not None:
        return f"not applicable: {_short(mon.idle_reason)}"
    if name == "GradientNoiseScale":
        return _coverage_cell(run)
    if name == "SpectralAlignment":
        layers = mon.layers
        kinds: dict[str, int] = {}
        for m in layers.values():
            kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
        what = ", ".join(f"{n} {k}" for k, n in kinds.items())
        return f"covered: {len(layers)} layer{'s' if len(layers) != 1 else ''} ({what})"
    if name == "GradientWeightAlignment":
        shift = ", labels shifted (causal LM)" if mon._shift else ""
        return f"covered: head `{mon._head_name}`{shift}"
    if name == "GradientEarlyStopping":
        return f"covered: {len(mon.components)} components"
    return "covered"


MONITORS = ("SpectralAlignment", "GradientNoiseScale", "GradientWeightAlignment", "GradientEarlyStopping",
            "DivergenceGuard")


def table(runs: list[ZooRun]) -> str:
    head = "| model family | " + " | ".join(MONITORS) + " |"
    rule = "|" + "---|" * (len(MONITORS) + 1)
    rows = [f"| {r.family} | " + " | ".join(_cell(r, m) for m in MONITORS) + " |" for r in runs]
    return "\n".join([head, rule, *rows])


def render(runs: list[ZooRun]) -> str:
    lines = [
        "# Model coverage",
        "",
        "Generated by `python benchmarks/coverage_table.py` (do not edit by hand): a tiny random-init model of "
        f"each family trained {STEPS} steps (batch {BATCH}) in `Trainer.fit` on CPU with every monitor on, checks "
        f"every {EVERY} steps. Each cell is what the monitor itself reported: *covered*, *partial* with the share "
        "of the gradient's squared norm its per-example norms account for (`gns/coverage`, partial below "
        "`min_coverage` = 0.9), or *not applicable* with the reason the monitor gave when it stayed idle "
        "(`nothing_to_watch`). `tests/test_model_zoo.py` trains the same zoo and checks that every logged "
        "value is finite.",
        "",
        table(runs),
        "",
        "Reasons in short:",
        "",
        "* BatchNorm is never covered by per-example norms: its batch statistics couple the examples of a batch.",
        "* Position embeddings indexed by positions broadcast over the batch (GPT-2's `wpe`, BERT's and ViT's "
        "position embeddings) have no per-example gradient to separate; the probe finds that by running the "
        "model on a 2-example slice of the batch and seeing which input dimensions follow the batch size.",
        "* `nn.MultiheadAttention`'s self-attention is covered (its packed input projection and its `out_proj`, "
        "through its own forward with `F.linear` intercepted); its cross-attention input projection has no "
        "per-example rule. `nn.LSTM`, `nn.GRU` and `nn.RNN` are covered from a float32 replay of the recurrence in "
        "the backward (not with `proj_size`, dropout between layers in training, or a `PackedSequence` input).",
        "* Spectral alignment watches `nn.Linear`, Hugging Face `Conv1D` (its weight transposed), ungrouped "
        "`nn.Conv2d` (its weight as `[C_out, C_in*kh*kw]` against input patches) and `nn.MultiheadAttention` (its "
        "packed input projection against the query, its `out_proj` against the attention's output), not the output "
        "head.",
        "* GradES components are the weight matrices inside numbered blocks (transformer projections, a "
        "ResNet's stage convolutions) and `nn.MultiheadAttention`'s two projections wherever it is.",
        "",
    ]
    return "\n".join(lines)


def finite_report(run: ZooRun) -> list[str]:
    """Keys with a non-finite logged value."""
    return [k for k, series in run.scalars.items() if any(not math.isfinite(v) for _, v in series)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "model_coverage.md"))
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"),
                        help="README whose coverage block to update ('' to leave it)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, entry in enumerate(zoo()):
            run = fit_zoo_model(entry, os.path.join(tmp, str(i)))
            bad = finite_report(run)
            if bad:
                raise SystemExit(f"{entry.family}: non-finite values logged for {bad}")
            runs.append(run)
    text = render(runs)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(text)
    if args.readme:
        update_readme(args.readme, text)


README_START, README_END = "<!-- coverage table: benchmarks/coverage_table.py -->", "<!-- end of coverage table -->"


def update_readme(path: str, text: str) -> None:
    """Replace the block between the README's coverage markers with the table of ``text``, each cell cut to
    its verdict (covered / partial with its share / not applicable); the reasons stay in the full table."""
    rows = [line for line in text.splitlines() if line.startswith("|")]

    def short(cell: str) -> str:
        cell = cell.strip()
        if cell.startswith("partial"):
            share = re.search(r"[0-9.]+%", cell)
            return f"partial ({share.group(0)})" if share else "partial"
        return cell.split(":")[0]

    table = [rows[0], rows[1]] + [
        "| " + " | ".join([cells[0].strip()] + [short(c) for c in cells[1:]]) + " |"
        for cells in (row.strip("|").split("|") for row in rows[2:])
    ]
    with open(path, encoding="utf-8") as fh:
        readme = fh.read()
    if README_START not in readme or README_END not in readme:
        raise SystemExit(f"{path}: no coverage markers ({README_START} ... {README_END})")
    head, rest = readme.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(head + README_START + "\n" + "\n".join(table) + "\n" + README_END + tail)


if __name__ == "__main__":
    main()
