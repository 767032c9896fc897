"""LightningCLI: the example YAML trains; the suite's callbacks resolve by short class name after
``import lightning_monitor`` (also when Lightning is imported after it); every monitor can be set in YAML,
a function argument by its dotted import path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("jsonargparse")

import lightning_monitor as lm  # noqa: E402
from lightning_monitor.callbacks.gradient_weight_alignment import default_target_fn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TINY = ["--model.config.n_layer=1", "--model.config.n_head=2", "--model.config.d_model=32",
        "--model.config.block_size=32", "--data.block_size=32", "--data.batch_size=8"]


def test_example_yaml_trains_with_a_short_name_added(tmp_path) -> None:
    args = [
        sys.executable, os.path.join(EXAMPLES, "cli.py"), "fit", "--config", os.path.join(EXAMPLES, "cli_config.yaml"),
        "--trainer.max_steps=4", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.callbacks+=DivergenceGuard", "--trainer.callbacks.action=warn", *TINY,
    ]
    out = subprocess.run(args, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = os.path.join(str(tmp_path), "gpt", "version_0")
    with open(os.path.join(run, "config.yaml"), encoding="utf-8") as fh:
        config = yaml.safe_load(fh)
    paths = [cb["class_path"] for cb in config["trainer"]["callbacks"]]
    assert paths == ["lightning_monitor.HealthMonitor", "lightning_monitor.DivergenceGuard"]
    assert config["trainer"]["callbacks"][1]["init_args"]["action"] == "warn"
    assert "HealthMonitor: watching sa, gns, gwa, guard" in out.stderr  # the explicit guard took the preset's place
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run))


def test_short_names_resolve_when_lightning_is_imported_after_the_package() -> None:
    code = (
        "import sys\n"
        "import lightning_monitor\n"
        "assert 'lightning.pytorch' not in sys.modules\n"
        "from lightning.pytorch.cli import LightningCLI\n"
        "from jsonargparse import ArgumentParser\n"
        "from lightning.pytorch import Callback\n"
        "parser = ArgumentParser()\n"
        "parser.add_argument('--callbacks', type=list[Callback])\n"
        "names = ['DivergenceGuard', 'HealthMonitor', 'SpectralAlignmentMonitor', 'GradientNoiseScaleMonitor',\n"
        "         'GradientWeightAlignmentMonitor', 'GradientEarlyStopping', 'TensorBoardDashboard', 'AlertWebhook']\n"
        "cfg = parser.parse_args(['--callbacks=' + str([{'class_path': n} for n in names])])\n"
        "built = parser.instantiate_classes(cfg).callbacks\n"
        "assert [type(cb).__name__ for cb in built] == names, built\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_every_monitor_in_yaml_by_short_name(tmp_path) -> None:
    import cli

    config = {
        "trainer": {
            "accelerator": "cpu", "max_steps": 3, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0,
            "default_root_dir": str(tmp_path),
            "callbacks": [
                {"class_path": "SpectralAlignmentMonitor", "init_args": {"every_n_steps": 2}},
                {"class_path": "GradientNoiseScaleMonitor", "init_args": {"every_n_steps": 2}},
                {"class_path": "GradientWeightAlignmentMonitor", "init_args": {
                    "target_fn": "lightning_monitor.callbacks.gradient_weight_alignment.default_target_fn"}},
                {"class_path": "GradientEarlyStopping", "init_args": {"stop": False}},
                {"class_path": "DivergenceGuard", "init_args": {"action": "warn", "every_n_steps": 2}},
            ],
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    built = cli.main(["--config", str(path), *TINY], run=False)
    callbacks = [cb for cb in built.trainer.callbacks if isinstance(cb, lm.Monitor)]
    assert [type(cb) for cb in callbacks] == [
        lm.SpectralAlignmentMonitor, lm.GradientNoiseScaleMonitor, lm.GradientWeightAlignmentMonitor,
        lm.GradientEarlyStopping, lm.DivergenceGuard,
    ]
    assert callbacks[2].target_fn is default_target_fn
    assert callbacks[0].every_n_steps == 2 and callbacks[4].action == "warn"
    built.trainer.fit(built.model, datamodule=built.datamodule)
    assert built.trainer.global_step == 3
    assert "sa/sign_diversity_mean" in built.trainer.callback_metrics
