"""A small GPT-style character model, its embedded corpus and its LightningModule, in one file.

Nothing is downloaded: :func:`make_corpus` writes the training text from a small seeded grammar.
Two domains share one character vocabulary:

* ``"prose"``: sentences about animals, places and weather (pre-training text);
* ``"arith"``: addition facts such as ``"17 plus 25 is 42."`` (a downstream task whose answer digits
  measure accuracy; used for fine-tuning).

The model names its projections the HuggingFace way (``attn.q_proj``, ``attn.k_proj``, ``attn.v_proj``,
``attn.o_proj``, ``mlp.up_proj``, ``mlp.down_proj``) and its output ``lm_head``.

Run ``python examples/gpt.py`` to train it for a few hundred steps on CPU.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

# ----------------------------------------------------------------------------- corpus

VOCAB = "\n !',.0123456789:;?abcdefghijklmnopqrstuvwxyz"
STOI = {c: i for i, c in enumerate(VOCAB)}

_ANIMALS = ["fox", "owl", "cat", "dog", "heron", "otter", "crow", "hare", "wolf", "mole", "wren", "deer"]
_ADJS = ["quick", "small", "old", "grey", "quiet", "bright", "tired", "clever", "young", "brave", "wet"]
_PLACES = ["river", "hill", "mill", "forest", "field", "bridge", "garden", "harbour", "valley", "road"]
_VERBS = ["sees", "follows", "watches", "finds", "leaves", "crosses", "remembers", "avoids", "greets"]
_WEATHER = ["rain", "snow", "wind", "fog", "sun", "frost"]
_TIMES = ["at dawn", "at noon", "in the evening", "at night", "in spring", "in winter", "after the storm"]


def _sentence(rng: random.Random) -> str:
    a, b = rng.choice(_ANIMALS), rng.choice(_ANIMALS)
    form = rng.randrange(5)
    if form == 0:
        return f"the {rng.choice(_ADJS)} {a} {rng.choice(_VERBS)} the {b} near the {rng.choice(_PLACES)}."
    if form == 1:
        return f"{rng.choice(_TIMES)}, the {a} walks to the {rng.choice(_ADJS)} {rng.choice(_PLACES)}."
    if form == 2:
        return f"there is {rng.choice(_WEATHER)} over the {rng.choice(_PLACES)}, so the {a} stays home."
    if form == 3:
        return f"does the {a} know the {b}? yes, the {a} {rng.choice(_VERBS)} it {rng.choice(_TIMES)}."
    return f"the {b} said: the {rng.choice(_PLACES)} is {rng.choice(_ADJS)} today; {a}s like that."


def _fact(rng: random.Random) -> str:
    x, y = rng.randrange(100), rng.randrange(100)
    return f"{x} plus {y} is {x + y}."


def make_corpus(domain: str = "prose", n_chars: int = 200_000, seed: int = 0) -> str:
    """Deterministic text of about ``n_chars`` characters from ``domain`` (``"prose"`` or ``"arith"``)."""
    if domain not in ("prose", "arith"):
        raise ValueError(f"`domain` must be 'prose' or 'arith', got {domain!r}.")
    rng = random.Random(seed)
    make = _sentence if domain == "prose" else _fact
    parts: list[str] = []
    size = 0
    while size < n_chars:
        line = " ".join(make(rng) for _ in range(rng.randrange(2, 6))) + "\n"
        parts.append(line)
        size += len(line)
    return "".join(parts)


def encode(text: str) -> Tensor:
    return torch.tensor([STOI[c] for c in text], dtype=torch.long)


def decode(ids: Tensor) -> str:
    return "".join(VOCAB[i] for i in ids.tolist())


class WindowDataset(Dataset):
    """``n_samples`` fixed random windows of ``block_size + 1`` tokens (input and shifted target)."""

    def __init__(self, tokens: Tensor, block_size: int, n_samples: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = tokens
        self.block_size = block_size
        self.starts = torch.randint(0, len(tokens) - block_size - 1, (n_samples,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        s = int(self.starts[i])
        chunk = self.tokens[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def make_loader(
    domain: str = "prose",
    block_size: int = 64,
    batch_size: int = 16,
    n_samples: int = 4096,
    seed: int = 0,
    shuffle: bool = True,
    n_chars: int = 200_000,
) -> DataLoader:
    """A DataLoader over windows of the ``domain`` corpus (split ``seed`` decides text and windows)."""
    tokens = encode(make_corpus(domain, n_chars=n_chars, seed=seed))
    ds = WindowDataset(tokens, block_size, n_samples, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=g, drop_last=True)


# ----------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    vocab_size: int = len(VOCAB)
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    mlp_ratio: int = 4
    layernorm: bool = True
    dropout: float = 0.0
    #: look the positions up per example (``(batch, time)`` indices) rather than once for the batch: the same values
    #: and gradient, and the position table then has per-example gradients (the noise scale's probe covers it)
    batched_positions: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.n_head

        def split(z: Tensor) -> Tensor:
            return z.view(b, t, h, d // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down_proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        norm = (lambda: nn.LayerNorm(cfg.d_model)) if cfg.layernorm else nn.Identity
        self.ln_1 = norm()
        self.attn = Attention(cfg)
        self.ln_2 = norm()
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model) if cfg.layernorm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos.expand(idx.shape[0], t) if self.cfg.batched_positions else pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTModule(pl.LightningModule):
    """Trains :class:`GPT` with AdamW.

    Args:
        config: model shape (:class:`GPTConfig` or a dict of its fields).
        lr: learning rate; with ``lr_end`` set, it ramps linearly from ``lr`` to ``lr_end`` over
            ``ramp_steps`` optimizer steps (a ramp past the edge of stability), else stays constant.
        weight_decay: AdamW weight decay.
        nan_at_step: fault injection for demos and tests: the loss of this optimizer step becomes NaN.
    """

    def __init__(
        self,
        config: Optional[GPTConfig | dict[str, Any]] = None,
        lr: float = 3e-3,
        lr_end: Optional[float] = None,
        ramp_steps: int = 1000,
        weight_decay: float = 0.01,
        nan_at_step: Optional[int] = None,
    ) -> None:
        super().__init__()
        cfg = config if isinstance(config, GPTConfig) else GPTConfig(**(config or {}))
        self.save_hyperparameters({"config": vars(cfg), "lr": lr, "lr_end": lr_end, "ramp_steps": ramp_steps,
                                   "weight_decay": weight_decay})
        self.model = GPT(cfg)
        self.lr, self.lr_end, self.ramp_steps = lr, lr_end, ramp_steps
        self.weight_decay = weight_decay
        self.nan_at_step = nan_at_step

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        if self.nan_at_step is not None and self.global_step == self.nan_at_step:
            loss = loss * float("nan")
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("val/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(0.9, 0.95),
        )
        if self.lr_end is None:
            return opt
        ratio = self.lr_end / self.lr
        ramp = max(1, self.ramp_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 + (ratio - 1.0) * min(s, ramp) / ramp)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


if __name__ == "__main__":
    pl.seed_everything(0)
    trainer = pl.Trainer(max_steps=300, logger=False, enable_checkpointing=False, accelerator="cpu")
    trainer.fit(GPTModule(), make_loader("prose"), make_loader("prose", seed=100, n_samples=256, shuffle=False))
