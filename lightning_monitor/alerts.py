"""Alerts: the record every monitor raises, and the sinks that carry it.

Every alert reaches, on global rank 0:

* the console, for warnings, criticals and the info alerts that report an action or a path
  (:data:`CONSOLE_INFO_KINDS`: the run stopped, rolled back, components frozen, batch-size advice),
  once per alert record (a persisting condition raises one record when it starts, one when it
  escalates and one when it clears). While the application has not configured logging (the root
  logger has no handler) a handler of the ``lightning_monitor`` logger prints them on stderr; once
  it has, the records reach its handlers instead, as Lightning's own messages do, so that nothing is
  printed twice. The other info alerts go to Python logging only;
* Python logging, logger name ``lightning_monitor`` (info -> INFO, warning -> WARNING,
  critical -> CRITICAL);
* every Lightning logger in ``trainer.loggers`` as the cumulative count of alerts per severity,
  ``alerts/count/info``, ``alerts/count/warning`` and ``alerts/count/critical``: logged at every
  alert (with the previous counts one step before, so that a plotted line is a staircase rather than
  a ramp between sparse points), and at the start and the end of training;
* TensorBoard's Text tab, one entry per alert (readable Markdown), tag ``alerts/<monitor>/<kind>``
  (a cleared condition under the tag of its condition) at the alert's step; a second alert on the
  same tag and step gets the tag ``alerts/<monitor>/<kind>/2`` (then ``/3`` ...), because TensorBoard
  shows one entry per tag and step;
* the append-only file ``alerts.jsonl`` of the run (:func:`alerts_dir`: the first logger's versioned
  log directory), one JSON object per line, flushed and fsynced per alert so that it survives a
  crash.

Every record carries the ``run_id`` of the fit that raised it, chosen on rank 0 when the hub is
created and broadcast to the other ranks. The hub keeps its place in ``alerts.jsonl`` in every
checkpoint (callback state ``AlertHub``): a fit resumed from a checkpoint into the same file moves
the records written after that checkpoint (the steps the resumed run replays) to
``alerts.superseded.jsonl``, so that no alert is recorded twice for a step. An incomplete last line,
left by a process killed while writing it, is skipped by :func:`read_alerts` and removed when the
next run opens the file.

Every rank hears every alert it raises through :meth:`AlertHub.subscribe`, so that acting callbacks
(:class:`~lightning_monitor.DivergenceGuard`) can reduce a decision across ranks, and sinks such as
:class:`~lightning_monitor.webhook.AlertWebhook` can forward them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, Optional

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "Alert", "AlertHub", "CONSOLE_INFO_KINDS", "Severity", "SEVERITY_LEVELS", "alerts_dir", "log", "new_run_id",
    "read_alerts", "read_records",
]

log = logging.getLogger("lightning_monitor")

Severity = Literal["info", "warning", "critical"]
SEVERITY_LEVELS: dict[str, int] = {"info": 1, "warning": 2, "critical": 3}
_PY_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}
ALERTS_FILENAME = "alerts.jsonl"
#: records a resumed run replaces (written after the checkpoint it resumed from) are moved here
SUPERSEDED_FILENAME = "alerts.superseded.jsonl"

#: Info alerts that report an action taken or a file written, printed on the console like warnings:
#: the guard stopped or rolled back the run (or skipped a non-finite step judged late, was rebased, or lifted an earlier
#: fit's rate ceiling), GradES froze
#: components or stopped, GWA stopped, and the noise scale's batch-size advice. An info alert whose ``details`` name a ``checkpoint`` or a ``path``
#: is printed too.
CONSOLE_INFO_KINDS = frozenset({
    "stopped", "rolled_back", "frozen", "all_frozen", "stop", "early_stop", "held_trainable", "infinite_buffers",
    "batch_below_noise_scale", "batch_above_noise_scale", "rebased", "lr_ceiling_lifted", "nonfinite_skipped",
})
_CONSOLE_FLAG = "lightning_monitor_console"


class _ConsoleHandler(logging.Handler):
    """Prints the records flagged for the console (and the package's other records from WARNING up) on
    ``sys.stderr`` (looked up at each record, so that a redirected stderr is honoured) while logging is not
    configured: the root logger has no handler and no other handler is attached to ``lightning_monitor``. Once
    the application configures logging, its handlers show the records and this one stays silent."""

    def __init__(self) -> None:
        super().__init__()
        self.set_name(_CONSOLE_FLAG)
        self.setFormatter(logging.Formatter("lightning_monitor %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        # an alert's record carries its console flag; any other record of the package's (the webhook's delivery
        # failures, an incomplete alert record removed) is printed from WARNING up, as Python's last-resort handler
        # would have printed it without this one
        flag = getattr(record, _CONSOLE_FLAG, None)
        shown = record.levelno >= logging.WARNING if flag is None else flag
        if not shown or logging.getLogger().handlers:
            return
        if any(h.get_name() != _CONSOLE_FLAG and not isinstance(h, logging.NullHandler) for h in log.handlers):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # pragma: no cover - logging must never raise into training
            self.handleError(record)


if not any(h.get_name() == _CONSOLE_FLAG for h in log.handlers):  # once, also across a module reload
    log.addHandler(_ConsoleHandler())
if log.level == logging.NOTSET:
    # info records are created (and reach a configured root logger's handlers); the console handler
    # still prints only the flagged ones
    log.setLevel(logging.INFO)


def _strict_json(obj: Any) -> Any:
    """``obj`` with every non-finite float inside it written as a string (``"inf"``, ``"nan"``): strict JSON, which
    readers other than Python's (``jq``, browsers) take (a rollback's learning-rate ceiling is ``inf`` for a group left
    uncapped)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict_json(v) for v in obj]
    return obj


def _clean_number(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(value)


@dataclass(frozen=True)
class Alert:
    """One alert raised by a monitor.

    Attributes:
        step: optimizer step the alert refers to (``trainer.global_step`` when it was measured).
        monitor: short name of the monitor that raised it (``"guard"``, ``"sa"``, ``"gns"`` ...).
        kind: what happened, e.g. ``"nonfinite_loss"``, ``"loss_spike"``, ``"collapse"``; a condition
            that clears raises ``"<kind>_cleared"`` with severity ``"info"``.
        severity: ``"info"``, ``"warning"`` or ``"critical"``. Critical alerts make a
            :class:`~lightning_monitor.DivergenceGuard` act.
        message: a sentence for humans, saying what to do where it can.
        value: the measured value behind the alert, if any (``nan``/``inf`` are kept as such).
        threshold: the threshold it crossed, if any.
        layer: the module's qualified name for a per-layer alert, else ``None``.
        details: structured facts behind an action, if any (e.g. the steps and batches of a rollback).
        run_id: the fit that raised it; the hub sets it when the alert is emitted.
    """

    step: int
    monitor: str
    kind: str
    severity: Severity
    message: str
    value: Optional[float] = None
    threshold: Optional[float] = None
    layer: Optional[str] = None
    details: Optional[dict[str, Any]] = None
    run_id: Optional[str] = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITY_LEVELS:
            raise ValueError(
                f"Alert severity must be one of {sorted(SEVERITY_LEVELS)}, got {self.severity!r}."
            )
        object.__setattr__(self, "step", int(self.step))
        object.__setattr__(self, "value", _clean_number(self.value))
        object.__setattr__(self, "threshold", _clean_number(self.threshold))

    @property
    def level(self) -> int:
        """Numeric severity: 1 info, 2 warning, 3 critical."""
        return SEVERITY_LEVELS[self.severity]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with every field; non-finite numbers become the strings ``"nan"``/``"inf"``."""
        out = asdict(self)
        for key in ("value", "threshold"):
            v = out[key]
            if v is not None and not math.isfinite(v):
                out[key] = str(v)
        if out.get("details"):
            out["details"] = _strict_json(out["details"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Alert:
        """Inverse of :meth:`to_dict` (reads a line of ``alerts.jsonl``); keys it does not know, written
        by a newer version, are ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"a record is a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        # a record written by something else (or edited by hand) is checked field by field: a wrong type read on
        # failed later, where the report used it, and the whole run's summary was lost to one line
        step = data.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step != int(step):
            raise ValueError(f"`step` must be an integer, got {step!r}")
        for key in ("monitor", "kind", "severity", "message"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"`{key}` must be a string, got {data.get(key)!r}")
        for key, kinds in (("layer", str), ("run_id", str), ("details", dict)):
            if data.get(key) is not None and not isinstance(data[key], kinds):
                raise ValueError(f"`{key}` must be a {kinds.__name__} or null, got {data[key]!r}")
        for key in ("value", "threshold"):
            v = data.get(key)
            if isinstance(v, str):
                data[key] = float(v)
            elif v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"`{key}` must be a number or null, got {v!r}")
        return cls(**data)

    @property
    def key(self) -> tuple[int, str, str, Optional[str]]:
        """``(step, monitor, kind, layer)``: what one record of a run says happened once."""
        return (self.step, self.monitor, self.kind, self.layer)

    @property
    def console(self) -> bool:
        """Whether the alert is printed on the console: warnings, criticals, and the info alerts
        that report an action or a path (:data:`CONSOLE_INFO_KINDS`)."""
        if self.severity != "info":
            return True
        details = self.details or {}
        return self.kind in CONSOLE_INFO_KINDS or "checkpoint" in details or "path" in details

    def to_markdown(self) -> str:
        """A short Markdown rendering for TensorBoard's Text tab."""
        where = f" on `{self.layer}`" if self.layer else ""
        lines = [f"**{self.severity.upper()}** `{self.monitor}/{self.kind}`{where} at step {self.step}", ""]
        lines.append(self.message)
        if self.value is not None or self.threshold is not None:
            lines.append("")
            lines.append(f"value: `{self.value}`, threshold: `{self.threshold}`")
        return "\n".join(lines)

    def __str__(self) -> str:
        where = f" [{self.layer}]" if self.layer else ""
        return f"[{self.severity}] {self.monitor}/{self.kind}{where} @ step {self.step}: {self.message}"


def alerts_dir(trainer: pl.Trainer) -> str:
    """Directory of ``alerts.jsonl`` (and of the guard's and GWA's files): the run's own folder.

    The first logger's ``log_dir`` where it has one (TensorBoard and CSV: ``<save_dir>/<name>/version_<n>``,
    a fresh folder per run); else ``<save_dir>/<name>/<version>`` of the first logger (MLflow:
    ``mlruns/<experiment id>/<run id>``, so that runs never share ``mlruns/``), under the trainer's
    ``default_root_dir`` for a logger that saves nothing locally; without a logger, the trainer's
    ``default_root_dir``.
    """
    if not trainer.loggers:
        return str(trainer.default_root_dir)
    first = trainer.loggers[0]
    log_dir = getattr(first, "log_dir", None)
    if log_dir:
        return str(log_dir)
    root = first.save_dir or trainer.default_root_dir
    parts = [str(part) for part in (first.name, first.version) if part not in (None, "")]
    return os.path.join(str(root), *parts)


def writes_files(trainer: pl.Trainer) -> bool:
    """Whether the run writes files: not under ``fast_dev_run``, where Lightning writes no logs and no checkpoints
    (its logger has no folder, and the files would land in the working directory)."""
    return not getattr(trainer, "fast_dev_run", False)


def read_alerts(path: str) -> list[Alert]:
    """Read an ``alerts.jsonl`` file back into :class:`Alert` records.

    An incomplete last line (a process killed while writing it) is skipped; any other line that is not
    an alert record raises ``ValueError`` naming the file and the line.
    """
    out = []
    for lineno, record in read_records(path)[0]:
        try:
            out.append(Alert.from_dict(record))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}:{lineno}: not an alert record ({err}).") from None
    return out


def read_records(path: str) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
    """``(line number, object)`` for every record of a JSONL file, and whether an incomplete last line
    was skipped. A last line that lacks only its newline but parses is kept; any other line that is not
    a JSON object raises ``ValueError`` naming the file and the line."""
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    out: list[tuple[int, dict[str, Any]]] = []
    torn = False
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = lineno == len(lines)  # no newline after it
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError as err:
            if last:
                torn = True
                continue
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err}).") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: not a JSON object.")
        out.append((lineno, record))
    return out, torn


def new_run_id() -> str:
    """A fresh run id: local time and six random hex digits, e.g. ``20250101-120000-3fa2c1``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _shared_run_id(trainer: pl.Trainer) -> str:
    """A fresh run id, chosen on rank 0 and broadcast: the hub is created in every rank's ``setup``."""
    run_id = new_run_id()
    if getattr(trainer, "world_size", 1) > 1:
        run_id = trainer.strategy.broadcast(run_id, src=0)
    return run_id


def _record_key(record: dict[str, Any]) -> tuple[Any, ...]:
    """:attr:`Alert.key` of a raw JSONL record."""
    try:
        step: Any = int(record.get("step"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        step = record.get("step")
    return (step, record.get("monitor"), record.get("kind"), record.get("layer"))


def _fsync_write(path: str, data: bytes, mode: str) -> int:
    """Write ``data`` to ``path`` (``"ab"`` or ``"wb"``), flushed and fsynced; the file's size after."""
    with open(path, mode) as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
        return fh.tell()


#: the TensorBoard text tag holding each fit's run id (see :meth:`AlertHub.log_run_id`)
RUN_ID_TAG = "lightning_monitor/run_id"


def _repair_tail(path: str) -> int:
    """Make ``path`` end with a complete line and return its size: an incomplete last record (a process
    killed while writing it) is removed, a complete one that lacks only its newline gets it."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return 0
    if not data or data.endswith(b"\n"):
        return len(data)
    cut = data.rfind(b"\n") + 1
    tail = data[cut:]
    try:
        complete = isinstance(json.loads(tail.decode("utf-8")), dict)
    except ValueError:
        complete = False
    if complete:
        return _fsync_write(path, b"\n", "ab")
    with open(path, "rb+") as fh:
        fh.truncate(cut)
        fh.flush()
        os.fsync(fh.fileno())
    log.warning("%s ended with an incomplete record (%d bytes, left by a process stopped while writing it); "
                "removed it.", path, len(tail))
    return cut


class AlertHub:
    """Dispatches alerts of every monitor attached to one trainer; one hub per trainer.

    Obtain it with :meth:`AlertHub.for_trainer`; monitors call :meth:`emit`. The hub keeps the
    alerts of the run in :attr:`history` (all ranks), the path of its JSONL file in :attr:`path`, the
    fit's :attr:`run_id` and the number of alerts per severity so far in :attr:`counts` (rank 0's when training
    starts, then each rank's own alerts added: what it puts into ``trainer.callback_metrics``).

    It adds a small callback to the trainer (:class:`AlertHubCallback`, state key ``AlertHub``) that
    saves its place in ``alerts.jsonl`` in every checkpoint, resumes the file when a fit resumes from
    a checkpoint (:meth:`resume`) and logs the counts when training starts and ends.
    """

    #: the trainer's attribute holding its hub. Kept on the trainer, not in a registry keyed by it: the hub reaches the
    #: trainer back (its subscribers are monitors, which hold the module, which holds the trainer), so a registry's entry
    #: never expired, and every fit of a process kept its model, probes and buffers alive (gigabytes a fit on a GPU)
    _ATTRIBUTE = "_lightning_monitor_alert_hub"

    def __init__(self, trainer: pl.Trainer, run_id: Optional[str] = None) -> None:
        self._trainer_ref = weakref.ref(trainer)
        self.history: list[Alert] = []
        self._subscribers: list[Callable[[Alert], None]] = []
        self.path: Optional[str] = None
        self.run_id: str = run_id or new_run_id()
        self._begin_counts()

    def _begin_counts(self) -> None:
        self.counts = dict.fromkeys(SEVERITY_LEVELS, 0)
        self._count_step = -1  # last step the counts were logged at: they are logged at steps never going back
        self._counts_logged: dict[str, float] = {}  # the counts logged then
        self._text_entries: dict[tuple[str, int], int] = {}  # (tag, step) -> entries written
        self._offset = 0  # size of the alerts file after this hub's last write (rank 0)
        self._kept_keys: set[tuple[Any, ...]] = set()  # keys of the records a resume kept: never written again
        self._finished = False
        self._file_error: Optional[str] = None  # why alerts.jsonl could not be written (said once; not tried again)
        self._training = False  # the fit's training has started (its step is the run's): counts are logged

    @classmethod
    def for_trainer(cls, trainer: pl.Trainer) -> AlertHub:
        """The hub of ``trainer``, created (and its log directory checked) on first use; a new fit of the
        same trainer gets a new run id, and continues the counts when it writes the same ``alerts.jsonl``.
        Called in every rank's ``setup`` (the run id is broadcast)."""
        hub = getattr(trainer, cls._ATTRIBUTE, None)
        if hub is None:
            hub = cls(trainer, run_id=_shared_run_id(trainer))
            hub._prepare_file(trainer)
            # an alerts.jsonl that earlier fits wrote (another Trainer into the same folder: a fixed `version`): the
            # counts continue from its records, so that those logged in a folder add up to its file (a fit from a
            # checkpoint takes the counts of that checkpoint instead, see resume)
            hub.counts = _file_counts(hub.path) if hub.path and trainer.global_rank == 0 else hub.counts
            setattr(trainer, cls._ATTRIBUTE, hub)
            hub._attach(trainer)
        elif hub._finished and _fitting(trainer):
            path, counts, count_step, entries = hub.path, hub.counts, hub._count_step, hub._text_entries
            hub.run_id = _shared_run_id(trainer)
            hub._begin_counts()
            hub._prepare_file(trainer)
            if hub.path == path:
                # the same alerts.jsonl (the same logger folder) holds the earlier fits' records: the cumulative
                # counts continue from them, and the logged series (the same steps) never go back. A fit from a
                # checkpoint takes the counts of that checkpoint, and its steps, instead (see resume)
                hub.counts, hub._count_step, hub._text_entries = counts, count_step, entries
        return hub

    def _attach(self, trainer: pl.Trainer) -> None:
        callbacks = getattr(trainer, "callbacks", None)
        if not isinstance(callbacks, list):
            return
        kind = _hub_callback_type()
        mine = [i for i, cb in enumerate(callbacks) if isinstance(cb, kind)]
        if any(callbacks[i].hub is self for i in mine):
            return
        if mine:
            # the callback of another trainer's hub (a callbacks list reused): replaced where it stands, so
            # that the Trainer, which may be iterating over the list, skips nothing
            callbacks[mine[0]] = kind(self)
        else:
            callbacks.append(kind(self))

    def _prepare_file(self, trainer: pl.Trainer) -> None:
        if not writes_files(trainer):
            self.path = None  # fast_dev_run: the alerts reach the console and Python logging, no file
            return
        directory = alerts_dir(trainer)
        self.path = os.path.join(directory, ALERTS_FILENAME)
        if trainer.global_rank != 0:
            return
        try:
            os.makedirs(directory, exist_ok=True)
            # a probe file of its own: runs started together in one folder (a sweep's, tests in parallel) shared one
            # name, and one run's removal of it failed another's check ("cannot write alerts")
            handle, probe = tempfile.mkstemp(prefix=f".{ALERTS_FILENAME}.", suffix=".probe", dir=directory)
            os.close(handle)
            os.remove(probe)
        except OSError as err:
            raise PermissionError(
                f"lightning_monitor cannot write alerts to {directory!r} ({err.strerror}). Pass a writable "
                "`save_dir` to the first logger, or a writable `default_root_dir` to the Trainer."
            ) from err
        self._offset = _repair_tail(self.path)

    def subscribe(self, callback: Callable[[Alert], None]) -> None:
        """Call ``callback(alert)`` for every alert emitted on this rank (all ranks)."""
        if callback not in self._subscribers:
            self._subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[Alert], None]) -> None:
        if callback in self._subscribers:
            self._subscribers.remove(callback)

    def emit(self, alert: Alert) -> None:
        """Stamp ``alert`` with the run id, send it to every sink (rank 0) and to every subscriber
        (this rank)."""
        if alert.run_id is None:
            object.__setattr__(alert, "run_id", self.run_id)
        self.history.append(alert)
        before = dict(self.counts)
        self.counts[alert.severity] += 1  # on every rank: its callback metrics
        trainer = self._trainer_ref()
        if trainer is not None:
            if trainer.global_rank == 0:
                log.log(_PY_LEVELS[alert.severity], "%s", alert, extra={_CONSOLE_FLAG: alert.console})
            if self._training:
                # not before the fit's training starts (an alert at setup: a monitor with nothing to watch), whose step
                # is 0 in a fit resumed from a checkpoint (its step is not back yet), which made the counts' series
                # start there and the resume read as a fit started over; the start of training logs them at its step
                self.log_counts(trainer, alert.step, before)
            if trainer.global_rank == 0:
                self._write_sinks(trainer, alert)
        for callback in list(self._subscribers):
            callback(alert)

    def _write_sinks(self, trainer: pl.Trainer, alert: Alert) -> None:
        tag = self._text_tag(alert)
        for logger in trainer.loggers:
            writer = _tensorboard_writer(logger)
            if writer is not None:
                writer.add_text(tag, alert.to_markdown(), global_step=alert.step)
        self._write_file(alert)

    def _text_tag(self, alert: Alert) -> str:
        """``alerts/<monitor>/<kind>`` (a cleared condition under its condition's tag), suffixed
        ``/2``, ``/3`` ... for the second, third ... alert on that tag and step."""
        kind = alert.kind[: -len("_cleared")] if alert.kind.endswith("_cleared") else alert.kind
        tag = f"alerts/{alert.monitor}/{kind}"
        n = self._text_entries.get((tag, alert.step), 0) + 1
        self._text_entries[(tag, alert.step)] = n
        return tag if n == 1 else f"{tag}/{n}"

    def log_counts(self, trainer: pl.Trainer, step: int, before: Optional[dict[str, int]] = None) -> None:
        """Log :attr:`counts` as ``alerts/count/<severity>`` to every logger (rank 0), at ``step`` or at
        the last step they were logged at if that is later (a logged series never goes back); with
        ``before``, the previous counts one step earlier too, so that a line shows a step, not a ramp.
        On every rank they are put into ``trainer.callback_metrics`` (``EarlyStopping`` can monitor them)."""
        from lightning_monitor._values import publish  # not at import time: the report command reads alerts without torch

        after = {f"alerts/count/{sev}": float(n) for sev, n in self.counts.items()}
        publish(trainer, after)
        if trainer.global_rank != 0 or not trainer.loggers:
            return
        step = max(int(step), self._count_step)
        if step == self._count_step and after == self._counts_logged:
            return  # the same point again (the end of a fit whose last step raised an alert): not logged twice
        prev = None
        if before is not None and step - 1 > self._count_step:
            prev = {f"alerts/count/{sev}": float(n) for sev, n in before.items()}
        for logger in trainer.loggers:
            if prev is not None:
                logger.log_metrics(prev, step=step - 1)
            logger.log_metrics(after, step=step)
        self._count_step, self._counts_logged = step, after

    def log_run_id(self, trainer: pl.Trainer) -> None:
        """Write the fit's run id to every TensorBoard logger (rank 0, text ``RUN_ID_TAG`` at the fit's first step):
        which records of ``alerts.jsonl`` are this fit's, also where it raises none (``lightning-monitor report``
        reads it from a folder that several fits wrote)."""
        if trainer.global_rank != 0:
            return
        for logger in trainer.loggers:
            writer = _tensorboard_writer(logger)
            if writer is not None:
                writer.add_text(RUN_ID_TAG, self.run_id, global_step=trainer.global_step)

    def _write_file(self, alert: Alert) -> None:
        if self.path is None or alert.key in self._kept_keys or self._file_error is not None:
            return
        try:
            self._offset = _fsync_write(self.path, (json.dumps(alert.to_dict()) + "\n").encode("utf-8"), "ab")
        except OSError as err:
            # a sink never fails training (a disk that filled up, a folder removed or remounted since the check at
            # setup: the next alert ended the fit with the write's error). Said once; the alerts still reach the
            # loggers, the console and `history`, and the file is not written again in this fit (a write cut short
            # leaves a partial line, which a later record would have been appended to)
            self._file_error = f"{type(err).__name__}: {err}"
            log.warning("%s can no longer be written (%s); from step %d on, alerts reach the "
                        "loggers and the console but not that file.", self.path, self._file_error, alert.step)

    # ------------------------------------------------------------------ checkpoints and resume
    def state_dict(self) -> dict[str, Any]:
        """The hub's place in its alerts file, saved in every checkpoint (rank 0's is the one written)."""
        return {"path": os.path.abspath(self.path) if self.path else None, "offset": self._offset,
                "run_id": self.run_id}

    def resume(self, trainer: pl.Trainer, step: int, state: Optional[dict[str, Any]]) -> None:
        """Called when the fit resumes from a checkpoint saved at optimizer step ``step`` whose hub state
        is ``state`` (``None`` for a checkpoint without one).

        On rank 0, when the run writes the same ``alerts.jsonl`` as the run that saved the checkpoint,
        the records written after that checkpoint belong to steps this run replays: they move to
        ``alerts.superseded.jsonl`` and the replay writes its own. The records this run has already
        written (at setup) stay, except where they repeat a record kept. Without a hub state the
        records of other runs at steps ``>= step`` move. :attr:`counts` continue from the records kept.
        """
        # the steps from the checkpoint's on are replayed: their counts and texts are logged again there (an earlier
        # fit of the same Trainer had carried its last logged step and texts over)
        self._count_step = min(self._count_step, step - 1)
        self._text_entries = {k: n for k, n in self._text_entries.items() if k[1] < step}
        if trainer.global_rank != 0 or self.path is None or not os.path.exists(self.path):
            return
        if state is not None and state.get("path") != os.path.abspath(self.path):
            return  # this run writes a file of its own
        with open(self.path, "rb") as fh:
            data = fh.read()
        offset = state.get("offset") if state is not None else None
        exact = isinstance(offset, int) and 0 <= offset <= len(data) and (offset == 0 or data[offset - 1] == 0x0A)
        head, tail = (data[:offset], data[offset:]) if exact else (b"", data)
        kept: list[bytes] = []
        moved: list[bytes] = []
        keys: set[tuple[Any, ...]] = set()
        counts = dict.fromkeys(SEVERITY_LEVELS, 0)

        def keep(raw: bytes, record: Optional[dict[str, Any]]) -> None:
            kept.append(raw)
            if record is not None:
                keys.add(_record_key(record))
                if _severity(record) in counts:
                    counts[record["severity"]] += 1

        for raw in head.split(b"\n"):
            if raw.strip():
                keep(raw, _parse_record(raw))
        for raw in tail.split(b"\n"):
            if not raw.strip():
                continue
            record = _parse_record(raw)
            if record is None:
                moved.append(raw)
                continue
            mine = record.get("run_id") == self.run_id
            before_checkpoint = not exact and isinstance(_record_key(record)[0], int) and _record_key(record)[0] < step
            if not (mine or before_checkpoint):
                moved.append(raw)
            elif _record_key(record) not in keys:
                keep(raw, record)
        new = b"".join(raw + b"\n" for raw in kept)
        if new != data:
            tmp = self.path + ".tmp"
            _fsync_write(tmp, new, "wb")
            os.replace(tmp, self.path)
        if moved:
            superseded = os.path.join(os.path.dirname(self.path), SUPERSEDED_FILENAME)
            _fsync_write(superseded, b"".join(raw + b"\n" for raw in moved), "ab")
            log.info("Resumed from the checkpoint of step %d: moved %d alert record(s) written after it to %s; "
                     "the steps replayed write their own.", step, len(moved), superseded)
        self._offset = len(new)
        self._kept_keys = keys
        self.counts = counts


def _file_counts(path: str) -> dict[str, int]:
    """The records of each severity in the alerts file ``path`` (none where it does not exist)."""
    counts = dict.fromkeys(SEVERITY_LEVELS, 0)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return counts
    for raw in data.split(b"\n"):
        record = _parse_record(raw) if raw.strip() else None
        if record is not None and _severity(record) in counts:
            counts[record["severity"]] += 1
    return counts


def _severity(record: dict[str, Any]) -> Optional[str]:
    """A record's severity where it is a string (a record written by other code may hold anything there)."""
    severity = record.get("severity")
    return severity if isinstance(severity, str) else None


def _parse_record(raw: bytes) -> Optional[dict[str, Any]]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _fitting(trainer: Any) -> bool:
    state = getattr(trainer, "state", None)
    return state is not None and state.fn == "fit" and state.status == "running"


def _hub_callback_type() -> type:
    """The class of the hub's callback, defined on first use so that importing this module (as the
    ``report`` command does) does not import Lightning."""
    existing = globals().get("AlertHubCallback")
    if existing is not None:
        return existing
    from lightning.pytorch.callbacks import Callback

    class AlertHubCallback(Callback):
        """The :class:`AlertHub`'s hooks in the fit: its place in ``alerts.jsonl`` in every checkpoint,
        the resume of that file, the alert counts when training starts and ends. Added by the hub."""

        def __init__(self, hub: Optional[AlertHub]) -> None:
            self.hub = hub

        @property
        def state_key(self) -> str:
            return "AlertHub"

        def _hub_of(self, trainer: pl.Trainer) -> Optional[AlertHub]:
            hub = self.hub
            return hub if hub is not None and hub._trainer_ref() is trainer else None

        def state_dict(self) -> dict[str, Any]:
            return self.hub.state_dict() if self.hub is not None else {}

        def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                               checkpoint: dict[str, Any]) -> None:
            hub = self._hub_of(trainer)
            if hub is not None:
                state = (checkpoint.get("callbacks") or {}).get(self.state_key)
                hub.resume(trainer, int(checkpoint.get("global_step", 0)), state)

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            hub = self._hub_of(trainer)
            if hub is not None:
                hub._training = True
                if getattr(trainer, "world_size", 1) > 1:
                    # rank 0's: the counts of the alerts file it continues, or of the checkpoint resumed from
                    hub.counts = dict(trainer.strategy.broadcast(hub.counts, src=0))
                hub.log_counts(trainer, trainer.global_step)
                hub.log_run_id(trainer)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            hub = self._hub_of(trainer)
            if hub is not None:
                hub.log_counts(trainer, trainer.global_step)

        def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            hub = self._hub_of(trainer)
            if hub is not None and stage == "fit":
                hub._finished = True

        def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
            # a fit that raised is over too (Lightning calls no callback's `teardown` then): the next fit of the same
            # Trainer gets a run id of its own, as after a fit that ended (its alerts went under the failed fit's)
            hub = self._hub_of(trainer)
            state = getattr(trainer, "state", None)
            if hub is not None and state is not None and state.fn == "fit":
                hub._finished = True

        def __getstate__(self) -> dict[str, Any]:
            return {"hub": None}  # the hub holds a weak reference to its trainer: it does not travel

    AlertHubCallback.__module__ = __name__
    AlertHubCallback.__qualname__ = "AlertHubCallback"
    globals()["AlertHubCallback"] = AlertHubCallback
    return AlertHubCallback


def __getattr__(name: str) -> Any:
    if name == "AlertHubCallback":
        return _hub_callback_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tensorboard_writer(logger: Any) -> Any:
    """The ``SummaryWriter`` of a TensorBoard logger, else ``None``."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if isinstance(logger, TensorBoardLogger):
        return logger.experiment
    return None
