"""A 2-rank run of DivergenceGuard on CPU (gloo): ``--strategy fsdp2`` (ModelParallelStrategy, every Linear
``fully_shard``-ed, parameters and gradients DTensors) or ``--strategy ddp``. The same model, data and seed
either way; the learning rate jumps at step 33. Each rank writes what its guard judged and did to
``<out>/<strategy>-rank<r>.json``. Run by tests/test_sharded.py (a subprocess: ModelParallelStrategy
launches its ranks by re-running the script)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import lightning.pytorch as pl
import torch

from lightning_monitor import DivergenceGuard

warnings.filterwarnings("ignore")


def shard_every_linear(net: torch.nn.Sequential, mesh) -> None:
    """FSDP2: ``fully_shard`` every Linear of ``net``, then ``net`` itself, over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    for m in net:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)


class Regression(pl.LightningModule):
    def __init__(self, jump_at: int, shard: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.jump_at, self.shard = jump_at, shard
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(4096, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def configure_model(self) -> None:
        if self.shard:
            shard_every_linear(self.net, self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        if self.global_step == self.jump_at:
            self.optimizers().param_groups[0]["lr"] = 5.0
        lo = ((2 * batch_idx + self.global_rank) * 16) % 4096  # each rank its own data
        return torch.nn.functional.mse_loss(self.net(self.x[lo:lo + 16]), self.y[lo:lo + 16])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(256)), batch_size=1)


class RecordingGuard(DivergenceGuard):
    """Records every (step, loss, grad norm) it judges."""

    def _judge(self, step, loss, gnorm, scaler_on):
        self.seen.append((step, loss, gnorm))
        return super()._judge(step, loss, gnorm, scaler_on)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("fsdp2", "ddp"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    guard = RecordingGuard(every_n_steps=5)
    guard.seen = []
    trainer = pl.Trainer(max_steps=50, accelerator="cpu", devices=2, strategy=strategy, callbacks=[guard],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=args.out)
    model = Regression(jump_at=33, shard=args.strategy == "fsdp2")
    trainer.fit(model)
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    with open(os.path.join(args.out, f"{args.strategy}-rank{trainer.global_rank}.json"), "w") as fh:
        json.dump({"seen": guard.seen, "rollbacks": [(r["step"], r["to_step"]) for r in guard.rollbacks],
                   "alerts": [(a.step, a.kind) for a in guard.hub.history if a.severity != "info"],
                   "weights": [float(v) for v in torch.cat([p.detach().flatten() for p in params])]}, fh)
    destroy_process_group()


def destroy_process_group() -> None:
    """While the interpreter is alive: Lightning destroys the group at exit for NCCL only, and a gloo group
    torn down during interpreter finalization can abort the process ("terminate called without an active
    exception"), as ``tests/conftest.py`` explains for the spawned tests."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
