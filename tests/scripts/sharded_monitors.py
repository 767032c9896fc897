"""A 2-rank run of the monitors (SpectralAlignmentMonitor, GradientEarlyStopping, GradientNoiseScaleMonitor
with ``method='per_example'``, GradientWeightAlignmentMonitor) on CPU (gloo): ``--strategy fsdp2``
(ModelParallelStrategy, every Linear ``fully_shard``-ed, parameters and gradients DTensors) or ``--strategy ddp``.
The same model, data and seed either way. Each rank writes every value its monitors logged, their alerts and the
GradES frozen set to ``<out>/<strategy>-rank<r>.json``. ``--only NAME`` attaches one monitor (``sa``, ``grades``,
``gns``, ``gwa``); ``--gns-method`` picks the noise-scale method (the default, ``per_example``, is supported
under FSDP2); ``--branch`` adds a layer one rank uses and the other does not; ``--val`` adds a validation loop every 8 steps (and
the sanity check's) and leaves the last Linear to the root's FSDP unit, whose parameters FSDP2 keeps gathered after a
forward that no backward follows. Run by tests/test_sharded.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import lightning.pytorch as pl
import torch

from lightning_monitor import (
    GradientEarlyStopping,
    GradientNoiseScaleMonitor,
    GradientWeightAlignmentMonitor,
    SpectralAlignmentMonitor,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharded_guard import destroy_process_group, shard_every_linear  # noqa: E402

warnings.filterwarnings("ignore")


class Branch(torch.nn.Module):
    """``net``, then a Linear (first in parameter order) that rank 0's batches use and rank 1's keep in the graph at
    0 (an expert no example of the rank is routed to): the ranks measure different parameters. One FSDP unit."""

    def __init__(self, net: torch.nn.Module, rank: int) -> None:
        super().__init__()
        self.aux = torch.nn.Linear(4, 4)
        self.net = net
        self.rank = rank

    def forward(self, x):
        out = self.net(x)
        if self.rank == 0:
            return out + self.aux(out)
        return out + 0.0 * (self.aux.weight.sum() + self.aux.bias.sum())


class Classifier(pl.LightningModule):
    def __init__(self, shard: bool, branch: bool = False, val: bool = False) -> None:
        super().__init__()
        self.branch = branch
        self.val = val
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.shard = shard
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(2048, 8, generator=g)
        self.y = (self.x @ torch.randn(8, 4, generator=g)).argmax(-1)

    def configure_model(self) -> None:
        if self.branch:
            torch.manual_seed(1)
            self.net = Branch(self.net, self.global_rank)
        if self.shard and self.branch:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
        elif self.shard and self.val:
            from torch.distributed.fsdp import fully_shard

            for m in list(self.net)[:-1]:  # the last Linear belongs to the root's unit
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
        elif self.shard:
            shard_every_linear(self.net, self.device_mesh["data_parallel"])

    def forward(self, x, y=None):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def train_dataloader(self):  # the distributed sampler gives each rank its own half, the same under both
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)


class WithValidation(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x[:256], self.y[:256]), batch_size=32)


def record(monitor, sink: dict) -> None:
    """Wrap ``monitor.log_metrics`` to keep every logged value per step."""
    original = monitor.log_metrics

    def log_metrics(trainer, metrics, step, *args, **kwargs):
        host = original(trainer, metrics, step, *args, **kwargs)
        sink.setdefault(str(step), {}).update({k: float(v) for k, v in host.items()})
        return host

    monitor.log_metrics = log_metrics


def time_calls(obj, method: str, sink: list, when=None) -> None:
    """Wrap ``obj.<method>`` to record its wall time per call (the check's cost, communication included);
    with ``when``, only the calls whose arguments it accepts."""
    import time

    original = getattr(obj, method)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if when is None or when(*args):
                sink.append(time.perf_counter() - t0)

    setattr(obj, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("fsdp2", "ddp"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default=None)
    parser.add_argument("--gns-method", default="per_example")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--branch", action="store_true")
    parser.add_argument("--val", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = "ddp_find_unused_parameters_true"  # GradES freezes parameters mid-run
    monitors = {
        "sa": SpectralAlignmentMonitor(every_n_steps=5, baseline_checks=2, head=None),
        # (the loss still falls at step 10: the progress rule would hold the freeze this test follows)
        "grades": GradientEarlyStopping(tau=0.011, threshold="absolute", grace_steps=10, every_n_steps=2,
                                        smoothing=0.5, stop=False, min_loss_progress=None),
        "gns": GradientNoiseScaleMonitor(method=args.gns_method, every_n_steps=4),
        "gwa": GradientWeightAlignmentMonitor(every_n_steps=1, log_histograms=False),
    }
    if args.only:
        monitors = {k: v for k, v in monitors.items() if k in args.only.split(",")}
    logged: dict[str, dict] = {k: {} for k in monitors}
    for k, m in monitors.items():
        record(m, logged[k])
    timings: dict[str, list] = {}
    for k, method in (("sa", "measure"), ("grades", "on_before_optimizer_step"), ("gns", "compute"),
                      ("gwa", "_on_head_forward")):
        if k in monitors:
            due = (lambda trainer, *_: monitors["grades"].is_due(trainer.global_step)) if k == "grades" else None
            time_calls(monitors[k], method, timings.setdefault(k, []), due)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=2, strategy=strategy,
                         callbacks=list(monitors.values()), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=args.out,
                         **(dict(val_check_interval=8, limit_val_batches=2, num_sanity_val_steps=2) if args.val else {}))
    model = (WithValidation if args.val else Classifier)(shard=args.strategy == "fsdp2", branch=args.branch, val=args.val)
    result = {"error": None}
    try:
        trainer.fit(model)
    except Exception as err:  # a refusal at setup: written down, compared by the test
        result["error"] = f"{type(err).__name__}: {err}"
    result["logged"] = logged
    result["seconds_per_check"] = {k: sorted(v)[len(v) // 2] if v else None for k, v in timings.items()}  # median
    result["alerts"] = {k: [(a.step, a.kind, a.severity) for a in m.hub.history] for k, m in monitors.items()
                        if getattr(m, "hub", None) is not None}
    if "grades" in monitors:
        result["frozen"] = dict(monitors["grades"].frozen)
    with open(os.path.join(args.out, f"{args.strategy}-rank{trainer.global_rank}.json"), "w") as fh:
        json.dump(result, fh)
    destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
