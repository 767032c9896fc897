"""Screenshots of the demo's runs in TensorBoard, taken with headless Chromium: the README's images.

1. Runs ``examples/demo.py --quick`` into a fresh directory (``--logdir`` to reuse existing runs).
2. A run logged without a dashboard layout (monitors constructed one by one, no
   ``TensorBoardDashboard``) gets one written into its directory, from the tags it logged.
3. Starts ``tensorboard --logdir`` on localhost, waits until it serves the runs and the layout, and
   takes each page with ``chromium --headless --screenshot`` (Debian: ``apt-get install chromium``):

   * ``dashboard.png``: the Custom Scalars tab (the health dashboard of both runs);
   * ``alerts.png``: the Text tab filtered to the guard's alerts (one entry per alert);
   * ``layers.png``: the Distributions tab filtered to the folded per-layer statistics, when logged.

Run: python benchmarks/screenshots.py [--out docs/img] [--logdir DIR] [--port 6006] [--shots dashboard.png ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SHOTS = (  # (file, URL fragment, window height)
    ("dashboard.png", "#custom_scalars", 1000),
    ("alerts.png", "#text&tagFilter=guard", 1300),
    ("layers.png", "#distributions&tagFilter=layers", 660),
)


def run_dirs(logdir: str) -> list[str]:
    files = glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)
    return sorted({os.path.dirname(f) for f in files})


def ensure_layout(run: str) -> Optional[str]:
    """Write a layout into ``run`` if it has none, from the monitors and per-layer keys it logged;
    returns what was done."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from lightning_monitor.dashboard import LAYER_STATS, health_layout, write_layout

    ea = EventAccumulator(run, size_guidance={"scalars": 1, "tensors": 1, "histograms": 1})
    ea.Reload()
    if "custom_scalars__config__" in ea.Tags()["tensors"]:
        return None
    scalars = ea.Tags()["scalars"]
    monitors = sorted({t.split("/")[0] for t in scalars if t.split("/")[0] in ("sa", "gns", "gwa", "grades")})
    per_layer = [m for m in monitors
                 if m in LAYER_STATS and any(t.startswith(m + "/") and t.count("/") == 2 for t in scalars)]
    writer = SummaryWriter(run)
    write_layout(writer, health_layout(monitors, per_layer))
    writer.close()
    return f"layout written into {run} (monitors {monitors}, per layer {per_layer})"


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read().decode())


def wait_for_tensorboard(base: str, runs: int, timeout: float = 120.0) -> None:
    """Until TensorBoard lists ``runs`` runs and serves a Custom Scalars layout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if len(get_json(base + "/data/runs")) >= runs and get_json(base + "/data/plugin/custom_scalars/layout"):
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"TensorBoard at {base} did not serve {runs} runs and a layout within {timeout:.0f} s")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("no Chromium found: apt-get install -y chromium")


def screenshot(browser: str, url: str, path: str, width: int, height: int) -> None:
    args = [browser, "--headless", "--disable-gpu", "--hide-scrollbars", f"--screenshot={path}",
            f"--window-size={width},{height}", "--virtual-time-budget=15000", url]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    subprocess.run(args, check=True, capture_output=True, timeout=120)
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise RuntimeError(f"Chromium wrote no screenshot to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "img"))
    parser.add_argument("--logdir", default=None,
                        help="runs to show (default: run the quick demo into a fresh directory)")
    parser.add_argument("--port", type=int, default=6006)
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--shots", nargs="+", default=[name for name, _, _ in SHOTS], help="which of the pages to take")
    args = parser.parse_args()
    sys.path.insert(0, REPO)

    logdir = args.logdir
    if logdir is None:
        logdir = os.path.join(tempfile.mkdtemp(prefix="lm-screenshots-"), "runs")
        demo = os.path.join(REPO, "examples", "demo.py")
        subprocess.run([sys.executable, demo, "--quick", "--root", logdir], check=True)
    runs = run_dirs(logdir)
    if not runs:
        raise SystemExit(f"no TensorBoard event files under {logdir}")
    for run in runs:
        done = ensure_layout(run)
        if done:
            print(done)

    os.makedirs(args.out, exist_ok=True)
    browser = chromium()
    base = f"http://localhost:{args.port}"
    tensorboard = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--port", str(args.port), "--host", "localhost"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_tensorboard(base, len(runs))
        tags = get_json(f"{base}/data/plugin/histograms/tags")
        histograms = any("/layers/" in tag for run_tags in tags.values() for tag in run_tags)
        for name, fragment, height in SHOTS:
            if name not in args.shots or (name == "layers.png" and not histograms):
                continue
            path = os.path.join(args.out, name)
            screenshot(browser, base + "/" + fragment, path, args.width, height)
            print(f"{path}: {base}/{fragment}")
    finally:
        tensorboard.terminate()
        tensorboard.wait(timeout=30)


if __name__ == "__main__":
    main()
