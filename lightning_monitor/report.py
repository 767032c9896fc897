"""``lightning-monitor report LOGDIR``: a run's health at a glance, from its log directory.

Reads the TensorBoard event files and ``alerts.jsonl`` of every run under ``LOGDIR`` (a folder with
event files or an ``alerts.jsonl``), prints a short summary (the alerts in order, what fired first,
the actions taken, ``B_simple`` against the batch size, the best GWA epoch, the frozen components,
the loss) and writes one self-contained HTML file per run (``health_report.html`` in the run's
folder, or ``--html PATH``) with inline SVG plots of the model-level signals, alerts marked.

Exit status: 0 when every run was read; 1 when a run is partial or corrupt (no scalars, alerts
without event files, an event file or a line of ``alerts.jsonl`` that cannot be read: the message
says which), or when a folder under ``LOGDIR`` cannot be listed (a run in it would be missing: said); 2 when ``LOGDIR``
does not exist or holds no run. Importing this module imports
neither torch nor Lightning.
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import math
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_monitor.alerts import ALERTS_FILENAME, RUN_ID_TAG, SEVERITY_LEVELS, SUPERSEDED_FILENAME, Alert

__all__ = ["RunReport", "find_runs", "load_run", "main", "render_html", "summarize"]

EVENT_PREFIX = "events.out.tfevents."
HTML_FILENAME = "health_report.html"
CSV_FILENAME = "metrics.csv"  # a CSVLogger's

#: Model-level panels of the figure: ``(title, tag names or None for the loss tags, log scale)``.
PANELS: tuple[tuple[str, Optional[tuple[str, ...]], bool], ...] = (
    ("loss", None, False),
    ("alerts: cumulative count per severity", ("alerts/count/critical", "alerts/count/warning", "alerts/count/info"),
     False),
    ("spectral alignment: sign diversity", ("sa/sign_diversity_mean", "sa/diversity_ratio", "sa/collapsed_fraction"),
     False),
    ("spectral alignment: sigma_1 growth", ("sa/sigma_growth",), False),
    ("gradient noise scale: B_simple vs batch size", ("gns/b_simple", "gns/batch_size"), True),
    ("gradient-weight alignment: score", ("gwa/score",), False),
    ("GradES: frozen fraction", ("grades/frozen_fraction",), False),
)

_MONITOR_PREFIXES = ("alerts/", "sa/", "gns/", "gwa/", "grades/", "guard/")
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b")
_SEVERITY_COLORS = {"critical": "#d62728", "warning": "#f0a202", "info": "#6c757d"}


@dataclass
class RunReport:
    """What a run's folder holds: its scalars, its alerts, and what could not be read."""

    path: str
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    event_files: list[str] = field(default_factory=list)
    #: problems that make the report partial (nonzero exit)
    problems: list[str] = field(default_factory=list)
    #: facts worth saying that are not problems (e.g. a last line cut by a kill)
    notes: list[str] = field(default_factory=list)
    #: the first step of the last event file, where it went back over the files before it (a resume or a new fit in
    #: the same folder): the earlier fits' points and alerts from there on were superseded
    restart: Optional[int] = None
    #: the run id the last event file's fit wrote (``RUN_ID_TAG``), where it wrote one
    last_run_id: Optional[str] = None
    #: whether the folder holds an alerts file (its records may all be an earlier fit's, left out)
    alerts_file: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------------------------------------- reading
def find_runs(logdir: str, unreadable: Optional[list[tuple[str, str]]] = None) -> list[str]:
    """Every folder under ``logdir`` (itself included) holding TensorBoard event files, a CSVLogger's
    ``metrics.csv`` or an ``alerts.jsonl``, sorted. ``unreadable``: where given, each folder that could not be listed
    is appended to it with the reason (a run in it would be missing from the list)."""
    runs = []

    def failed(error: OSError) -> None:
        if unreadable is not None:
            unreadable.append((str(error.filename or logdir), error.strerror or str(error)))

    for dirpath, dirnames, filenames in os.walk(logdir, onerror=failed):
        dirnames.sort()
        if (ALERTS_FILENAME in filenames or CSV_FILENAME in filenames
                or any(name.startswith(EVENT_PREFIX) for name in filenames)):
            runs.append(dirpath)
    return sorted(runs)


def _masked_crc32c(data: bytes) -> int:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    return masked_crc32c(data)


def check_event_file(path: str) -> tuple[int, Optional[str], bool]:
    """Walk the records of a TensorBoard event file (TFRecord framing, length and data checksums checked):
    ``(records, problem, truncated)``. ``problem`` says where the file stops being an event file;
    ``truncated``: the last record is cut short, as a process killed while writing leaves it (TensorBoard
    reads the records before it)."""
    records = 0
    with open(path, "rb") as fh:
        while True:
            start = fh.tell()
            header = fh.read(12)
            if not header:
                return records, None, False
            if len(header) < 12:
                return records, None, True
            length, length_crc = struct.unpack("<QI", header)
            if _masked_crc32c(header[:8]) != length_crc:
                return records, f"not a TensorBoard event record at byte {start} (checksum mismatch)", False
            body = fh.read(length + 4)
            if len(body) < length + 4:
                return records, None, True
            (data_crc,) = struct.unpack("<I", body[length:])
            if _masked_crc32c(body[:length]) != data_crc:
                # TensorBoard's reader stops quietly at such a record: the steps after it would be missing unsaid
                return records, (f"record {records} at byte {start} is damaged (data checksum mismatch); the "
                                 f"{records} records before it are read"), False
            records += 1


def _placeholder(tag: str, step: int) -> bool:
    """Whether a point is TensorBoardLogger's ``hp_metric`` placeholder (step 0), which tells nothing of the steps."""
    return tag == "hp_metric" and step == 0


def _read_scalars(run: RunReport) -> None:
    """Every scalar of the run's event files, file by file in the order they were written. A file whose first step
    is at or before steps of the files before it is a fit resumed from a checkpoint of that step (or a new run in the
    same folder): the earlier files' points from that step on were superseded, as the alerts of those steps are."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    guidance = {"scalars": 0, "histograms": 1, "images": 1, "audio": 1, "tensors": 1, "compressedHistograms": 1}

    def written(path: str) -> tuple[int, int, str]:  # events.out.tfevents.<unix time>.<host>.<pid>.<writer number>
        # the writers of one process are numbered: within one second, writer 10 came after writer 9 (compared as
        # text, "10" came first, and an earlier fit's file was read as the last one)
        parts = os.path.basename(path).split(".")
        when = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0
        return when, (int(parts[-1]) if len(parts) > 4 and parts[-1].isdigit() else 0), path

    files = sorted(run.event_files, key=written)
    superseded = 0
    for path in files:
        acc = EventAccumulator(path, size_guidance=guidance)
        acc.Reload()
        points = {tag: [(int(e.step), float(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags().get("scalars", [])}
        # TensorBoardLogger's `hp_metric` placeholder is written at step 0 by every fit of a module with
        # hyperparameters, a resumed one too: not where the fit started (a resume read as a fit started over at 0)
        steps = [st for tag, series in points.items() for st, _ in series if not _placeholder(tag, st)]
        if steps:
            start = min(steps)
            earlier = [st for tag, series in run.scalars.items() for st, _ in series if not _placeholder(tag, st)]
            if earlier and start < max(earlier):
                run.restart = start
            # a fit resumed from the checkpoint of step `start` logs again from there (the alert counts at its start);
            # what the earlier fit logged at that very step, before it saved the checkpoint (an epoch's end: GWA's
            # score), stays unless the later fit logs that tag there too
            again = {tag for tag, series in points.items() if any(st == start for st, _ in series)}
            for tag, series in run.scalars.items():
                kept = [(st, v) for st, v in series if st < start or (st == start and tag not in again)]
                superseded += sum(1 for st, _ in series if st > start)  # logged again at `start`: replaced, unsaid
                run.scalars[tag] = kept
        for tag, series in points.items():
            run.scalars.setdefault(tag, []).extend(series)
        run.last_run_id = None
        texts = acc.Tags().get("tensors", [])
        for tag in (RUN_ID_TAG + "/text_summary", RUN_ID_TAG):  # the name SummaryWriter.add_text gives, or the bare one
            if tag in texts:
                values = [e.tensor_proto.string_val[0] for e in acc.Tensors(tag) if e.tensor_proto.string_val]
                run.last_run_id = values[-1].decode("utf-8", "replace") if values else None
                break
    run.scalars = {tag: series for tag, series in run.scalars.items() if series}
    if superseded:
        run.notes.append(f"{superseded} scalar point(s) of an earlier fit were superseded by a later one that "
                         "resumed from an earlier step (or started over) in the same folder; the later ones are read.")


def _read_csv(run: RunReport, path: str) -> None:
    """The scalars of a CSVLogger's ``metrics.csv`` (one row per logged step and call; empty cells are metrics
    logged at other calls), in the order written."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        run.problems.append(f"{CSV_FILENAME}: cannot be read ({err}).")
        return
    for row in rows:
        try:
            step = int(float(row.get("step") or ""))
        except ValueError:
            continue
        for tag, cell in row.items():
            if tag in ("step", None) or cell in ("", None):
                continue
            try:
                run.scalars.setdefault(tag, []).append((step, float(cell)))
            except ValueError:
                continue
    run.scalars = {tag: series for tag, series in run.scalars.items() if series}
    if not run.scalars:
        run.problems.append(f"{CSV_FILENAME} holds no scalar: the run logged nothing yet.")


def _read_alerts(run: RunReport, path: str) -> None:
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            run.alerts.append(Alert.from_dict(json.loads(raw.decode("utf-8"))))
        except (ValueError, TypeError, AttributeError, OverflowError) as err:
            if lineno == len(lines):  # no newline after it: cut short by a kill
                run.notes.append(f"{ALERTS_FILENAME}: the last line is incomplete (a run stopped while writing "
                                 "it); ignored.")
            else:
                reason = "not valid JSON" if isinstance(err, json.JSONDecodeError) else str(err)
                run.problems.append(f"{ALERTS_FILENAME} line {lineno}: not an alert record ({reason}); skipped.")


def load_run(path: str) -> RunReport:
    """Read one run's folder; every problem lands in :attr:`RunReport.problems`, nothing raises."""
    run = RunReport(path)
    names = sorted(os.listdir(path))
    run.event_files = [os.path.join(path, n) for n in names if n.startswith(EVENT_PREFIX)]
    for event_file in run.event_files:
        name = os.path.basename(event_file)
        try:
            records, problem, truncated = check_event_file(event_file)
        except OSError as err:
            run.problems.append(f"{name}: cannot be read ({err.strerror or err}).")
            continue
        if problem:
            run.problems.append(f"{name}: corrupt, {problem}.")
        elif truncated:
            run.notes.append(f"{name}: the last record is cut short (a run stopped while writing it); the "
                             f"{records} records before it are read.")
        elif records == 0:
            run.notes.append(f"{name}: empty.")
    if run.event_files:
        try:
            _read_scalars(run)
        except Exception as err:  # tensorboard raises its own error types on unreadable files
            run.problems.append(f"the TensorBoard event files cannot be read ({type(err).__name__}: {err}).")
        if not run.scalars and not any("corrupt" in p for p in run.problems):
            run.problems.append("the TensorBoard event files hold no scalar: the run logged nothing yet, or "
                                "its files are incomplete.")
    elif os.path.exists(os.path.join(path, CSV_FILENAME)):
        _read_csv(run, os.path.join(path, CSV_FILENAME))
    else:
        run.problems.append("no TensorBoard event file or CSVLogger metrics.csv in this folder: only the alerts can be "
                            "reported.")
    alerts_path = os.path.join(path, ALERTS_FILENAME)
    if os.path.exists(alerts_path):
        run.alerts_file = True
        try:
            _read_alerts(run, alerts_path)
        except OSError as err:
            run.problems.append(f"{ALERTS_FILENAME}: cannot be read ({err.strerror or err}).")
        _drop_superseded_alerts(run)
    superseded = os.path.join(path, SUPERSEDED_FILENAME)
    if os.path.exists(superseded):
        # a fit resumed from a checkpoint moved the alerts written after it there: what the abandoned fit did
        try:
            with open(superseded, "rb") as fh:
                moved = sum(1 for line in fh if line.strip())
        except OSError:
            moved = 0
        if moved:
            run.notes.append(f"{moved} alert(s) of a fit abandoned after its checkpoint (the steps a resumed fit "
                             f"replayed) are in {SUPERSEDED_FILENAME}, not in this summary.")
    return run


def _drop_superseded_alerts(run: RunReport) -> None:
    """Several fits wrote into one folder (a fixed ``version``, ``logger=False``): the alerts of the earlier fits
    (run ids) from the step the last fit started at are left out, as their scalars are; a fit resumed from a checkpoint
    keeps the earlier fit's alerts before its checkpoint. The last fit starts at the first step of the last event file
    where that went back over the files before it (the earlier fits' alerts at that very step stay unless the last fit
    raised the same one: they came before the checkpoint, as an epoch-end alert does), else (no event file) at its own
    first alert."""
    run_ids = list(dict.fromkeys(a.run_id for a in run.alerts if a.run_id))
    # the last fit's run id, from its event file: a fit that raised no alert has no record to name it (its folder's
    # earlier fit was then taken for it, and its divergence reported as the last fit's)
    known = run.last_run_id is not None and run.restart is not None
    if not known and len(run_ids) < 2:
        return
    last = run.last_run_id if known else run_ids[-1]
    run_ids = [r for r in run_ids if r != last] + [last]
    start = run.restart
    if start is None:
        if run.event_files:
            return  # the event files show one continuing series: a resume, whose earlier records stay
        start = min(a.step for a in run.alerts if a.run_id == last)
    # from the event files: at the step it started from (a checkpoint's), the earlier fit's alerts raised before that
    # checkpoint stay, as its scalars there do, unless the last fit raised the same one
    again = {a.key for a in run.alerts if a.run_id == last and a.step == start} if run.restart is not None else None
    kept = [a for a in run.alerts if a.run_id == last or a.step < start
            or (again is not None and a.step == start and a.key not in again)]
    left = len(run.alerts) - len(kept)
    if left:
        run.alerts = kept
        run.notes.append(f"{left} alert(s) of earlier fits in this folder (run ids {', '.join(run_ids[:-1])}) at steps "
                         f">= {start}, where the last fit ({last}) started again, are left out; they are still in "
                         f"{ALERTS_FILENAME}.")


# ---------------------------------------------------------------------------------------------- summary
def _last(run: RunReport, tag: str) -> Optional[tuple[int, float]]:
    series = [(s, v) for s, v in run.scalars.get(tag, []) if math.isfinite(v)]
    return series[-1] if series else None


def loss_tags(run: RunReport) -> list[str]:
    """The scalar tags that look like a loss (``loss`` in the name, not a monitor's), training first."""
    tags = [t for t in run.scalars if "loss" in t.lower() and not t.startswith(_MONITOR_PREFIXES)]
    return sorted(tags, key=lambda t: (not t.lower().startswith("train"), t))[:3]


def _first_sentence(text: str, limit: int = 140, colon: bool = True) -> str:
    """The first sentence of ``text`` (up to a full stop, or a colon with ``colon``), at most ``limit`` characters."""
    cuts = [i for i in (text.find(". "), text.find(": ") if colon else -1) if i > 0]
    head = text[: min(cuts)] if cuts else text.rstrip(".")
    return head if len(head) <= limit else head[: limit - 3] + "..."


def _text(details: dict[str, Any], key: str) -> Optional[str]:
    """``details[key]`` where it is a non-empty string: a record written by other code, or edited by hand, may hold
    anything there (``alerts.jsonl`` is only checked down to ``details`` being an object)."""
    value = details.get(key)
    return value if isinstance(value, str) and value else None


def _action(alert: Alert) -> Optional[str]:
    d = alert.details or {}
    if alert.kind == "stopped":
        # why, and what the checkpoint holds (records written before these details: the checkpoint only)
        reasons, holds_text = _text(d, "reasons"), _text(d, "holds")
        why = f" ({_first_sentence(reasons, 240, colon=False)})" if reasons else ""
        where = f"; checkpoint {d['checkpoint']}" if d.get("checkpoint") else ""
        holds = f", which holds {_first_sentence(holds_text, 200, colon=False)}" if where and holds_text else ""
        return f"step {alert.step}: the guard stopped training{why}{where}{holds}"
    if alert.kind == "rolled_back":
        skipped = d.get("skipped", "?")
        return (f"step {alert.step}: the guard rolled back to the state of step {d.get('to_step', '?')}"
                f" ({skipped} {'batch' if skipped == 1 else 'batches'} skipped)")
    if alert.kind == "frozen":
        return f"step {alert.step}: GradES froze {alert.layer or '?'}"
    if alert.kind == "stop" and alert.monitor == "grades":
        return f"step {alert.step}: GradES stopped training ({_first_sentence(alert.message, 240, colon=False)})"
    if alert.kind == "early_stop":
        return f"step {alert.step}: {alert.monitor} stopped training ({_first_sentence(alert.message)})"
    if alert.kind in ("batch_below_noise_scale", "batch_above_noise_scale"):
        return f"step {alert.step}: batch-size advice: {_first_sentence(alert.message)}"
    return None


def _safe_action(alert: Alert) -> Optional[str]:
    """:func:`_action`, where an odd ``details`` field costs only this alert's line (it cost the run's summary)."""
    try:
        return _action(alert)
    except Exception as err:  # details of any shape, from other code or by hand
        return f"step {alert.step}: {alert.monitor}/{alert.kind} (its details cannot be read: {type(err).__name__})"


def _grades_components(run: RunReport) -> tuple[list[str], list[str], bool]:
    """GradES's components ``(still frozen, released)`` from its ``frozen`` and ``released`` alerts, replayed in the
    order raised: a component the run unfroze later was still listed as frozen. The last item: some ``released``
    alert names no ``components`` in its details (a record of an older version), so the frozen list may hold some."""
    frozen: list[str] = []
    released: list[str] = []
    unnamed = False
    for a in run.alerts:
        if a.kind == "frozen" and a.layer:
            frozen.append(a.layer)
        elif a.kind == "released" and a.monitor == "grades":
            names = (a.details or {}).get("components")
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                unnamed = True
                continue
            for name in names:
                if name in frozen:
                    frozen.remove(name)
                if name not in released:
                    released.append(name)
    return frozen, released, unnamed


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def summarize(run: RunReport, max_alerts: int = 40) -> str:
    """The text summary of one run."""
    lines = [f"Run: {run.path}"]
    # TensorBoardLogger's `hp_metric` placeholder is written at step 0 by every fit, a resumed one too: not a step of
    # the run (a fit resumed at step 97 read "steps logged: 0 .. 200")
    steps = [s for tag, series in run.scalars.items() if tag != "hp_metric" for s, _ in series]
    if steps:
        lines.append(f"  steps logged: {min(steps)} .. {max(steps)}; {len(run.scalars)} scalar tags")
    run_ids = list(dict.fromkeys(a.run_id for a in run.alerts if a.run_id))
    if len(run_ids) > 1:
        lines.append(f"  fits (run ids): {', '.join(run_ids)}")

    # alerts
    counted = {sev: int(max((v for _, v in run.scalars.get(f"alerts/count/{sev}", []) if math.isfinite(v)),
                            default=0)) for sev in SEVERITY_LEVELS}
    if not run.alerts and any(counted.values()) and not run.alerts_file:
        # the counts reach every logger, the records one folder: with several loggers, the first logger's
        text = ", ".join(f"{counted[sev]} {sev}" for sev in ("critical", "warning", "info") if counted[sev])
        lines.append(f"  alerts: {text} counted in the logged scalars, but this folder has no {ALERTS_FILENAME} "
                     "(with several loggers it is in the first logger's folder): report that folder for the alerts "
                     "and the actions")
    elif not run.alerts:
        lines.append("  alerts: none")
    else:
        by_sev = {sev: sum(a.severity == sev for a in run.alerts) for sev in SEVERITY_LEVELS}
        counts = ", ".join(f"{n} {sev}" for sev, n in sorted(by_sev.items(), key=lambda kv: -SEVERITY_LEVELS[kv[0]])
                           if n)
        lines.append(f"  alerts: {len(run.alerts)} ({counts})")
        serious = [a for a in run.alerts if a.severity != "info"]
        first = serious[0] if serious else run.alerts[0]
        lines.append(f"  fired first{' (warning or critical)' if serious else ''}: step {first.step} "
                     f"{first.monitor}/{first.kind}" + (f" [{first.layer}]" if first.layer else "")
                     + f" ({first.severity})")
        for a in run.alerts[:max_alerts]:
            where = f" [{a.layer}]" if a.layer else ""
            text = _first_sentence(a.message)
            lines.append(f"    step {a.step:>6}  {a.severity:<8} {a.monitor}/{a.kind}{where}: {text}")
        if len(run.alerts) > max_alerts:
            lines.append(f"    ... {len(run.alerts) - max_alerts} more in {ALERTS_FILENAME}")

    actions = [text for text in (_safe_action(a) for a in run.alerts) if text]
    elsewhere = not run.alerts and any(counted.values()) and not run.alerts_file
    lines.append("  actions taken:" + ("" if actions else " unknown (no alert records here)" if elsewhere else " none"))
    lines.extend(f"    {text}" for text in actions)

    # batch size against the noise scale
    b_simple, batch = _last(run, "gns/b_simple"), _last(run, "gns/batch_size")
    if b_simple is not None and batch is not None and batch[1] > 0:
        ratio = b_simple[1] / batch[1]
        if ratio >= 1:
            where = f"{ratio:.3g}x below B_simple"
        else:
            where = f"{1 / ratio:.3g}x above B_simple" if ratio > 0 else "far above B_simple (B_simple <= 0)"
        checks = len(run.scalars.get("gns/b_simple", []))
        # the monitor's own advice waits for 5 checks (min_checks): fewer are said to be few
        few = f" (from {checks} check{'s' if checks > 1 else ''} only: not settled)" if checks < 5 else ""
        lines.append(f"  batch size: {_fmt(batch[1])} vs B_simple = {_fmt(b_simple[1])} at step {b_simple[0]}: the "
                     f"batch is {where}{few}")
    elif b_simple is not None:
        lines.append(f"  B_simple: {_fmt(b_simple[1])} at step {b_simple[0]} (no gns/batch_size logged)")

    # GWA
    best_epoch = _last(run, "gwa/best_epoch")
    scores = [(s, v) for s, v in run.scalars.get("gwa/score", []) if math.isfinite(v)]
    if best_epoch is not None:
        # the scores the pick ranked: from the first epoch of the selection window on, where gwa/best_epoch starts; a
        # warm-up epoch's score, often the run's highest, read as a second "best" (epoch 1 against a step of epoch 0)
        opened = min(st for st, _ in run.scalars["gwa/best_epoch"])
        ranked = [(st, v) for st, v in scores if st >= opened]
        best = max(ranked, key=lambda sv: sv[1]) if ranked else None
        extra = f"; highest score in the selection window {_fmt(best[1])} at step {best[0]}" if best else ""
        if any(a.monitor == "gwa" and a.kind == "bimodal" for a in run.alerts):
            # such epochs log no score but rank above every score: the best epoch may be one of them
            extra += "; epochs of bimodal scores (no score logged) rank above every score"
        lines.append(f"  GWA: best epoch {int(best_epoch[1])} (gwa/best_epoch at step {best_epoch[0]}){extra}")
    elif scores:
        best = max(scores, key=lambda sv: sv[1])
        lines.append(f"  GWA: best score {_fmt(best[1])} at step {best[0]} (epoch-end scores: {len(scores)})")

    # GradES
    fraction = _last(run, "grades/frozen_fraction")
    frozen, released, unnamed = _grades_components(run)
    if fraction is not None or frozen or released:
        share = f"frozen fraction {_fmt(fraction[1])} at step {fraction[0]}" if fraction else ""
        if frozen:
            names = f"{len(frozen)} frozen: {', '.join(frozen)}"
        elif fraction is not None and fraction[1] > 0:
            # frozen before this log's first step (a run resumed from a checkpoint): its `frozen` alerts are the
            # earlier run's ("none frozen" beside a frozen fraction of 0.25 read as a contradiction)
            names = "components frozen before this log's first step (their `frozen` alerts are in the earlier run's)"
        else:
            names = "none frozen"
        if released:
            names += f"; {len(released)} released (unfrozen by the run, left to train): {', '.join(released)}"
        if unnamed and frozen:
            names += "; some of them may have been released since (the `released` alerts name them)"
        lines.append(f"  GradES: {names}" + (f" ({share})" if share else ""))

    # loss
    for tag in loss_tags(run):
        series = [(s, v) for s, v in run.scalars[tag] if math.isfinite(v)]
        if series:
            lines.append(f"  {tag}: {_fmt(series[0][1])} (step {series[0][0]}) -> {_fmt(series[-1][1])} "
                         f"(step {series[-1][0]}), lowest {_fmt(min(v for _, v in series))}")
    for note in run.notes:
        lines.append(f"  note: {note}")
    for problem in run.problems:
        lines.append(f"  problem: {problem}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- figure
def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    span = hi - lo
    if span <= 0 or not math.isfinite(span):
        return [lo]
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def svg_panel(title: str, series: dict[str, list[tuple[int, float]]], alerts: Sequence[Alert],
              x_range: tuple[int, int], log_y: bool = False, width: int = 900, height: int = 190) -> str:
    """One inline SVG line plot: ``series`` (name -> ``(step, value)``), a vertical line per alert
    (colour by severity, the alert in its tooltip), non-finite values left as gaps. Cumulative alert
    counts (``alerts/count/...``) are drawn as staircases: a count holds until the next point."""
    ml, mr, mt, mb = 64, 16, 22, 26
    pw, ph = width - ml - mr, height - mt - mb
    log_y = log_y and all(v > 0 for pts in series.values() for _, v in pts if math.isfinite(v))

    def ty(v: float) -> float:
        return math.log10(v) if log_y else v

    values = [ty(v) for pts in series.values() for _, v in pts if math.isfinite(v) and (not log_y or v > 0)]
    y_lo, y_hi = (min(values), max(values)) if values else (0.0, 1.0)
    if y_hi - y_lo < 1e-12:
        y_lo, y_hi = y_lo - (abs(y_lo) * 0.1 or 1.0), y_hi + (abs(y_hi) * 0.1 or 1.0)
    pad = (y_hi - y_lo) * 0.05
    y_lo, y_hi = y_lo - pad, y_hi + pad
    x_lo, x_hi = x_range
    x_span = (x_hi - x_lo) or 1

    def sx(step: float) -> float:
        return ml + (step - x_lo) / x_span * pw

    def sy(v: float) -> float:
        return mt + (1 - (v - y_lo) / (y_hi - y_lo)) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<text x="{ml}" y="14" font-size="13" font-weight="bold">{html.escape(title)}</text>',
           f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>']
    for t in _ticks(y_lo, y_hi):
        label = f"{10 ** t:.3g}" if log_y else f"{t:.3g}"
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
                   f'<text x="{ml - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{label}</text>')
    for t in _ticks(x_lo, x_hi, 6):
        out.append(f'<text x="{sx(t):.1f}" y="{height - 8}" text-anchor="middle">{int(t)}</text>')
    for a in alerts:
        if not x_lo <= a.step <= x_hi:
            continue
        color = _SEVERITY_COLORS[a.severity]
        out.append(f'<line x1="{sx(a.step):.1f}" x2="{sx(a.step):.1f}" y1="{mt}" y2="{mt + ph}" stroke="{color}" '
                   f'stroke-width="1.5" stroke-dasharray="4 2"><title>{html.escape(str(a))}</title></line>')
    legend_x = ml + 8 + 7 * len(title)
    for i, (name, pts) in enumerate(series.items()):
        severity = name.rsplit("/", 1)[-1] if name.startswith("alerts/count/") else None
        color = _SEVERITY_COLORS.get(severity, _COLORS[i % len(_COLORS)])
        segments: list[list[str]] = [[]]
        held: Optional[float] = None  # a staircase's last value, drawn up to the next point
        for step, v in pts:
            if math.isfinite(v) and (not log_y or v > 0):
                if severity is not None and held is not None:
                    segments[-1].append(f"{sx(step):.1f},{sy(ty(held)):.1f}")
                segments[-1].append(f"{sx(step):.1f},{sy(ty(v)):.1f}")
                held = v
            elif segments[-1]:
                segments.append([])
                held = None
        for seg in segments:
            if len(seg) == 1:
                x, y = seg[0].split(",")
                out.append(f'<circle cx="{x}" cy="{y}" r="2" fill="{color}"/>')
            elif seg:
                out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(seg)}"/>')
        out.append(f'<text x="{legend_x:.0f}" y="14" fill="{color}">&#9472; {html.escape(name)}</text>')
        legend_x += 6.5 * len(name) + 24
    out.append("</svg>")
    return "".join(out)


def render_html(run: RunReport, summary: str) -> str:
    """One self-contained HTML page: the summary, the model-level signals with alerts marked, the alerts."""
    steps = [s for pts in run.scalars.values() for s, _ in pts] + [a.step for a in run.alerts]
    x_range = (min(steps), max(steps)) if steps else (0, 1)
    marked = [a for a in run.alerts if a.console]
    panels = []
    for title, tags, log_y in PANELS:
        names = loss_tags(run) if tags is None else [t for t in tags if t in run.scalars]
        if names:
            panels.append(svg_panel(title, {t: run.scalars[t] for t in names}, marked, x_range, log_y))
    rows = "".join(
        f"<tr><td>{a.step}</td><td style='color:{_SEVERITY_COLORS[a.severity]}'>{a.severity}</td>"
        f"<td>{html.escape(a.monitor)}/{html.escape(a.kind)}</td><td>{html.escape(a.layer or '')}</td>"
        f"<td>{html.escape(a.message)}</td></tr>" for a in run.alerts)
    legend = " ".join(f"<span style='color:{c}'>&#9474; {sev}</span>" for sev, c in _SEVERITY_COLORS.items())
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Training health: {html.escape(run.path)}</title>
<style>
body {{ font-family: sans-serif; max-width: 940px; margin: 16px auto; color: #222; }}
pre {{ background: #f6f8fa; padding: 8px; white-space: pre-wrap; font-size: 12px; }}
table {{ border-collapse: collapse; font-size: 12px; }} td, th {{ border-bottom: 1px solid #ddd; padding: 2px 6px;
text-align: left; vertical-align: top; }}
</style></head><body>
<h1>Training health</h1>
<pre>{html.escape(summary)}</pre>
<h2>Model-level signals</h2>
<p>Dashed vertical lines: alerts ({legend}; info only for actions). Hover a line for the alert.</p>
{"".join(panels) or "<p>No model-level signal was logged.</p>"}
<h2>Alerts</h2>
{"<table><tr><th>step</th><th>severity</th><th>alert</th><th>layer</th><th>message</th></tr>" + rows + "</table>"
 if run.alerts else "<p>None.</p>"}
</body></html>
"""


# ---------------------------------------------------------------------------------------------- command
def report(logdir: str, html_path: Optional[str] = None, write_html: bool = True, out: Any = None,
           err: Any = None) -> int:
    """Report every run under ``logdir``; the exit status (see the module's docstring)."""
    out, err = out or sys.stdout, err or sys.stderr
    if not os.path.isdir(logdir):
        what = "is not a directory" if os.path.exists(logdir) else "does not exist"
        print(f"lightning-monitor report: {logdir!r} {what}.", file=err)
        return 2
    unreadable: list[tuple[str, str]] = []
    runs = find_runs(logdir, unreadable)
    for path, why in unreadable:  # a run in such a folder is not reported: said, and the report is partial
        print(f"lightning-monitor report: {path}: cannot be read ({why}); a run in it is not reported.", file=err)
    if not runs:
        if unreadable:
            return 1
        print(f"lightning-monitor report: no run under {logdir!r} (no TensorBoard event file, no "
              f"{ALERTS_FILENAME}). Pass the logger's save_dir or log_dir.", file=err)
        return 2
    if html_path is not None and len(runs) > 1:
        print(f"lightning-monitor report: --html names one file but {logdir!r} holds {len(runs)} runs; each "
              f"run's page is written to its folder instead.", file=err)
        html_path = None
    status = 1 if unreadable else 0
    for i, path in enumerate(runs):
        try:
            run = load_run(path)
            text = summarize(run)
            if write_html:
                target = html_path or os.path.join(path, HTML_FILENAME)
                try:
                    with open(target, "w", encoding="utf-8") as fh:
                        fh.write(render_html(run, text))
                    text += f"\n  figure: {target}"
                except OSError as e:
                    run.problems.append(f"cannot write {target} ({e.strerror or e}).")
        except Exception as e:  # a report never ends in a traceback
            run = RunReport(path, problems=[f"cannot be read ({type(e).__name__}: {e})."])
            text = f"Run: {path}"
        print(("\n" if i else "") + text, file=out)
        for problem in run.problems:
            print(f"lightning-monitor report: {path}: {problem}", file=err)
        if not run.ok:
            status = 1
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-monitor", description="lightning-monitor's command line.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    rep = sub.add_parser("report", help="summarize a run's health from its log directory",
                         description=__doc__.split("\n\n")[1] if __doc__ else None)
    rep.add_argument("logdir", metavar="LOGDIR", help="a run's log directory, or a folder of runs")
    page = rep.add_mutually_exclusive_group()
    page.add_argument("--html", metavar="PATH", help=f"where to write the HTML page (default: <run>/{HTML_FILENAME})")
    page.add_argument("--no-html", action="store_true", help="print the summary only")
    args = parser.parse_args(argv)
    if args.command != "report":
        parser.print_help(sys.stderr)
        return 2
    try:
        return report(args.logdir, html_path=args.html, write_html=not args.no_html)
    except BrokenPipeError:
        # the reader went away (`| head`): the rest is not wanted, and Python's flush at exit must not fail either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
