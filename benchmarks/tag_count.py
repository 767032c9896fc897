"""TensorBoard tags per model size: how many cards a run of HealthMonitor puts in TensorBoard.

The example GPT with 1, 4 and 32 blocks (d_model 32: the tags depend on the layers, not their width)
trains a few steps under ``HealthMonitor`` with every monitor due every 2 steps and an epoch of 4 steps
(so every key the run would ever log appears, GWA's per-epoch keys included). The event file is read
back and its tags counted per TensorBoard plugin: scalars (one card each in the Scalars tab),
histograms, text (alerts) and the Custom Scalars layout with its number of cards.

Configurations: ``HealthMonitor()`` (per-layer statistics folded into one histogram per statistic),
``HealthMonitor(per_layer_scalars=True)`` (one scalar per layer and statistic, as monitors
constructed one by one log them), and both with GradES on (``grades=True``: per-component keys).

Run: python benchmarks/tag_count.py [--layers 1 4 32] [--out benchmarks/out/tag_count.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import tempfile
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPTModule, make_loader  # noqa: E402

import lightning_monitor as lm  # noqa: E402

EVERY_2 = dict(spectral=dict(every_n_steps=2), noise_scale=dict(every_n_steps=2), guard=dict(every_n_steps=2))
CONFIGS: dict[str, dict[str, Any]] = {
    "HealthMonitor()": {},
    "HealthMonitor(per_layer_scalars=True)": {"per_layer_scalars": True},
    "HealthMonitor(grades=True)": {"grades": dict(every_n_steps=2, grace_steps=2, stop=False)},
    "HealthMonitor(grades=True, per_layer_scalars=True)": {
        "grades": dict(every_n_steps=2, grace_steps=2, stop=False), "per_layer_scalars": True},
}


def count_tags(n_layer: int, settings: dict[str, Any], root: str, steps: int = 8) -> dict[str, Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    pl.seed_everything(0, verbose=False)
    config = {"n_layer": n_layer, "n_head": 2, "d_model": 32, "block_size": 32}
    module = GPTModule(config)
    loader = make_loader("prose", block_size=32, batch_size=8, n_samples=32)  # 4 steps per epoch
    hm = lm.HealthMonitor(**{**EVERY_2, "gwa": dict(warmup_epochs=0)}, **settings)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=TensorBoardLogger(root, name="run", version=""),
        callbacks=[hm], enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=2,
    )
    trainer.fit(module, loader)
    trainer.logger.finalize("success")
    (run,) = {os.path.dirname(f) for f in glob.glob(os.path.join(root, "**", "events.out.tfevents.*"), recursive=True)}
    ea = EventAccumulator(run, size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    ea.Reload()
    tags = ea.Tags()
    texts = [t for t in tags["tensors"] if t != "custom_scalars__config__"]
    cards = 0
    if "custom_scalars__config__" in tags["tensors"]:
        layout = layout_pb2.Layout()
        layout.ParseFromString(ea.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
        cards = sum(len(c.chart) for c in layout.category)
    return {
        "n_layer": n_layer,
        "params": sum(p.numel() for p in module.parameters()),
        "scalars": len(tags["scalars"]),
        "histograms": len(tags["histograms"]),
        "text": len(texts),
        "total": len(tags["scalars"]) + len(tags["histograms"]) + len(texts),
        "dashboard_cards": cards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_monitor").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    rows = []
    for name, settings in CONFIGS.items():
        for n_layer in args.layers:
            with tempfile.TemporaryDirectory() as root:
                row = {"config": name, **count_tags(n_layer, settings, root)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| configuration | blocks | scalars | histograms | text | total tags | dashboard cards |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['config']}` | {r['n_layer']} | {r['scalars']} | {r['histograms']} | {r['text']} | "
              f"{r['total']} | {r['dashboard_cards']} |")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
