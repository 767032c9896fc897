"""The example of docs/writing_a_monitor.md runs as written: a monitor in under 40 lines, the base
carrying cadence, hook release, logging (loggers and callback_metrics), alerts and state."""

from __future__ import annotations

import os
import re

import lightning.pytorch as pl
from conftest import tb_scalars
from lightning.pytorch.loggers import TensorBoardLogger

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "writing_a_monitor.md")


def _example() -> tuple[type, int]:
    code = re.search(r"```python\n(.*?)```", open(DOC, encoding="utf-8").read(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, DOC, "exec"), namespace)
    body = code[code.index("class InputRMSMonitor"):]
    return namespace["InputRMSMonitor"], len([line for line in body.splitlines() if line.strip()])


def test_the_documented_monitor_is_short_and_works(tmp_path, tiny_gpt):
    monitor_cls, lines = _example()
    assert lines < 40
    pl.seed_everything(0)
    module, loader = tiny_gpt()
    mon = monitor_cls(every_n_steps=5, include="model.blocks.0.mlp.*", max_rms=0.5)
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="tb"),
                         callbacks=[mon], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(module, loader)
    scalars = tb_scalars(trainer.logger.log_dir)
    keys = sorted(k for k in scalars if k.startswith("rms/"))
    assert keys and all([s for s, _ in scalars[k]] == [0, 5, 10] for k in keys)  # due steps only
    assert set(keys) <= set(trainer.callback_metrics)  # Lightning callbacks can monitor the keys
    # the inputs of the MLP are well above 0.5 in RMS: one warning when it started, in the alert history
    assert [(a.kind, a.step) for a in mon.hub.history] == [("input_rms", 0)]
    assert not any(m._forward_hooks for m in module.modules())  # every hook released
