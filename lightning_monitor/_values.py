"""Where a monitor's values go: to the host in one transfer, to every logger, folded into histograms
over the layers, into ``trainer.callback_metrics``, and TensorBoard histograms. No Lightning callback
here: :class:`~lightning_monitor.callbacks.base.Monitor` calls these."""

from __future__ import annotations

import csv
import math
import os
import weakref
from collections.abc import Collection, Mapping
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_monitor._compat import callback_metrics_store
from lightning_monitor.alerts import _tensorboard_writer

__all__ = ["TrainerRef", "fold_layers", "log_histogram", "publish", "to_host", "write_csv"]


class TrainerRef:
    """A weak reference to the Trainer a monitor runs in; pickles (``ddp_spawn``) and deep-copies as
    an empty one, so a monitor stays picklable."""

    __slots__ = ("_ref",)

    def __init__(self, trainer: Optional[pl.Trainer] = None) -> None:
        self._ref = weakref.ref(trainer) if trainer is not None else None

    def __call__(self) -> Optional[pl.Trainer]:
        return self._ref() if self._ref is not None else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (TrainerRef, ())


def to_host(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """All values on the host, with a single device-to-host transfer for the tensors: a tensor of
    one element (or a number) becomes a float, a tensor of more elements a list of floats."""
    out: dict[str, Any] = {}
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    if keys:
        parts = [metrics[k].detach().float().reshape(-1) for k in keys]
        flat = torch.cat(parts).cpu().tolist() if len(parts) > 1 else parts[0].cpu().tolist()
        at = 0
        for k, part in zip(keys, parts):
            n = part.numel()
            out[k] = flat[at] if n == 1 else flat[at:at + n]
            at += n
    for k, v in metrics.items():
        if not isinstance(v, Tensor):
            out[k] = float(v)
    return {k: out[k] for k in metrics}


def fold_layers(host: Mapping[str, float], layer_keys: Mapping[str, str]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """``(scalars, {stat: finite per-layer values})``: the keys of ``layer_keys`` (per-layer key ->
    statistic) grouped by statistic, the rest as scalars (everything as scalars when ``layer_keys`` is
    empty). Non-finite values are left out of the groups: a histogram cannot bin them, and the
    model-level keys and alerts report them."""
    if not layer_keys:
        return dict(host), {}
    scalars: dict[str, float] = {}
    per_stat: dict[str, list[float]] = {}
    for k, v in host.items():
        stat = layer_keys.get(k)
        if stat is None:
            scalars[k] = v
        elif math.isfinite(v):
            per_stat.setdefault(stat, []).append(v)
    return scalars, per_stat


def publish(trainer: pl.Trainer, values: Mapping[str, float], exclude: Collection[str] = ()) -> None:
    """Put host ``values`` into ``trainer.callback_metrics`` as 0-dim float32 CPU tensors, so that
    ``EarlyStopping`` and ``ModelCheckpoint`` can monitor any key.

    Every rank must call this with the same keys: those callbacks reduce their decision across
    ranks only when the monitored key is present, so a key missing on one rank would hang the
    others. A key keeps its last value until it is published again (as with ``self.log``); a key
    never published is absent. Values of reduced quantities are the same on all ranks; values a
    rank measures on its own data (spectral alignment) are that rank's, which is what the
    callbacks' cross-rank reduction of their decisions expects.
    """
    keys = [k for k in values if k not in exclude]
    if not keys:
        return
    # one tensor, viewed per key: ~1 us per key, no device involved
    tensors = torch.tensor([float(values[k]) for k in keys], dtype=torch.float32).unbind(0)
    callback_metrics_store(trainer).update(zip(keys, tensors))


def log_histogram(trainer: pl.Trainer, tag: str, values: Tensor, step: int) -> None:
    """A histogram of ``values`` to every TensorBoard logger of ``trainer``, on global rank 0."""
    if trainer.global_rank != 0:
        return
    for logger in trainer.loggers:
        writer = _tensorboard_writer(logger)
        if writer is not None:
            writer.add_histogram(tag, values.detach().float().cpu(), global_step=step)


def write_csv(path: str, header: list[str], rows: list[tuple], append: bool = False) -> None:
    """``rows`` to the CSV file ``path``: appended (the header written once), or the file rewritten."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    new = not (append and os.path.exists(path))
    with open(path, "a" if append else "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        if new:
            writer.writerow(header)
        writer.writerows(rows)
