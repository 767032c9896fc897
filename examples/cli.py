"""LightningCLI over the example GPT, with the suite's callbacks set in YAML or on the command line.

    python examples/cli.py fit --config examples/cli_config.yaml
    python examples/cli.py fit --config examples/cli_config.yaml --trainer.callbacks+=DivergenceGuard

After ``import lightning_monitor`` the suite's callbacks resolve by their short class names
(``DivergenceGuard``, ``HealthMonitor`` ...) as well as by their full paths
(``lightning_monitor.DivergenceGuard``), and an argument that takes a function (GWA's ``target_fn``)
takes its dotted import path.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

import lightning_monitor  # noqa: F401  (makes the callbacks' short class names resolve)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPTModule, make_loader  # noqa: E402


class GPTData(pl.LightningDataModule):
    """The generated ``prose`` corpus as training and validation windows of ``block_size`` tokens."""

    def __init__(self, block_size: int = 64, batch_size: int = 16, train_samples: int = 1600,
                 val_samples: int = 128) -> None:
        super().__init__()
        self.block_size, self.batch_size = block_size, batch_size
        self.train_samples, self.val_samples = train_samples, val_samples

    def train_dataloader(self) -> DataLoader:
        return make_loader("prose", block_size=self.block_size, batch_size=self.batch_size,
                           n_samples=self.train_samples)

    def val_dataloader(self) -> DataLoader:
        return make_loader("prose", block_size=self.block_size, batch_size=self.batch_size, n_samples=self.val_samples,
                           seed=100, shuffle=False)


def main(args: Optional[list[str]] = None, run: bool = True, **kwargs: Any) -> LightningCLI:
    """The CLI; ``args`` instead of ``sys.argv``, ``run=False`` to only build trainer, model and data."""
    return LightningCLI(GPTModule, GPTData, args=args, run=run, save_config_kwargs={"overwrite": True}, **kwargs)


if __name__ == "__main__":
    main()
