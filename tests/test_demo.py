"""The README's first command runs examples/demo.py: keep it working (short run)."""

from __future__ import annotations

import os
import subprocess
import sys

from lightning_monitor import read_alerts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_quick_runs_and_the_guard_rescues_the_diverging_run(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--quick", "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "raised nothing critical; the diverging run was rolled back" in out.stdout, out.stdout[-3000:]
    assert f"tensorboard --logdir {tmp_path}" in out.stdout
    # each run in its own versioned folder; the healthy run raised no warning (its docstring: "nothing alarms"; the
    # noise scale's partial coverage of the position table was one) and nothing about divergence
    healthy = tmp_path / "healthy" / "version_0" / "alerts.jsonl"
    if healthy.exists():
        assert not [a for a in read_alerts(str(healthy)) if a.monitor == "guard" or a.severity != "info"]
    alerts = read_alerts(str(tmp_path / "diverging" / "version_0" / "alerts.jsonl"))
    assert f"alerts file: {tmp_path / 'diverging' / 'version_0' / 'alerts.jsonl'}" in out.stdout
    rolled = [a for a in alerts if a.kind == "rolled_back"]
    assert rolled and not [a for a in alerts if a.kind == "stopped"]
    assert any(a.severity == "critical" and a.step <= rolled[0].step for a in alerts)  # acted on the step it judged
    assert f"rolled back at step {rolled[0].step} to the state of step {rolled[0].details['to_step']}" in out.stdout
    # the run's progress is printed, and only paths that exist
    assert "healthy: step 50/250" in out.stdout and "diverging: step 250/250" in out.stdout
    for line in out.stdout.splitlines():
        if line.strip().startswith("alerts file:"):
            assert os.path.exists(line.split("alerts file:")[1].strip())
