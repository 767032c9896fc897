"""A webhook sink for alerts: posts them as ``{"text": ...}`` JSON (what Slack and Microsoft Teams
incoming webhooks accept) from a background thread, so that a slow or unreachable server never
blocks or fails training.

Add it to the Trainer next to the monitors::

    from lightning_monitor.webhook import AlertWebhook

    trainer = pl.Trainer(callbacks=[*monitors, AlertWebhook(min_severity="warning")])

The URL comes from the ``url`` argument or, without it, from the environment variable
``LIGHTNING_MONITOR_WEBHOOK_URL`` (keep secrets out of configs); without either, the sink warns once
and stays idle. Only global rank 0 posts.

Delivery: each alert at or above ``min_severity`` joins a bounded queue that one daemon thread drains
with the standard library's ``urllib.request``; a failed post (connection refused, timeout, HTTP 5xx,
408 or 429) is retried ``retries`` times with exponential backoff, other HTTP errors are not. A redirect
is not followed: it fails the post, naming the address it points to (``urllib`` would re-send a POST
redirected by 301, 302 or 303 as a GET without its body, and count the alert delivered). When the
queue is full the oldest alert is dropped and counted. At the end of the fit (or on an exception) the
sink waits at most ``flush_timeout`` seconds for the queue to drain and logs what was not delivered.
An instance also works without a Trainer: call it with an :class:`~lightning_monitor.Alert`, or pass it
to :meth:`AlertHub.subscribe <lightning_monitor.AlertHub.subscribe>`.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_monitor._args import check_nonnegative, check_positive
from lightning_monitor.alerts import SEVERITY_LEVELS, Alert, AlertHub, log

__all__ = ["AlertWebhook", "ENV_VAR"]

#: environment variable read when no ``url`` is given
ENV_VAR = "LIGHTNING_MONITOR_WEBHOOK_URL"

# HTTP statuses worth retrying: the server is busy or timed out; other 4xx mean a wrong URL or payload
_RETRY_STATUSES = frozenset({408, 429})


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuses every redirect: the response's 3xx status is raised as an ``HTTPError`` (see ``AlertWebhook._send``)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Deadline:
    """A connection whose socket is shut down ``timeout`` seconds after it connected, unless the answer's status and
    headers have come by then: the timeout bounds the request, not each read (a server that answered one byte a second
    held the one sender thread for good, and every later alert waited behind it). The body is not read (the status
    says whether the post was delivered)."""

    timeout: Any
    sock: Any

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self._timer: Optional[threading.Timer] = None
        if isinstance(self.timeout, (int, float)):
            self._timer = threading.Timer(float(self.timeout), self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read, which then fails
            except OSError:
                pass

    def getresponse(self) -> Any:
        response = super().getresponse()  # type: ignore[misc]
        self._cancel()
        return response

    def _cancel(self) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        self._cancel()
        super().close()  # type: ignore[misc]


class _DeadlineHTTPConnection(_Deadline, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_Deadline, http.client.HTTPSConnection):
    pass


class _DeadlineHTTP(urllib.request.HTTPHandler):
    def http_open(self, req: Any) -> Any:
        return self.do_open(_DeadlineHTTPConnection, req)


class _DeadlineHTTPS(urllib.request.HTTPSHandler):
    def https_open(self, req: Any) -> Any:
        kwargs: dict[str, Any] = {"context": getattr(self, "_context", None)}
        if hasattr(self, "_check_hostname"):
            kwargs["check_hostname"] = self._check_hostname
        return self.do_open(_DeadlineHTTPSConnection, req, **kwargs)


_OPENER = urllib.request.build_opener(_NoRedirect, _DeadlineHTTP, _DeadlineHTTPS)


class AlertWebhook(pl.Callback):
    """Posts alerts to a Slack/Teams-compatible webhook without ever blocking training.

    Args:
        url: the webhook URL; ``None`` reads ``$LIGHTNING_MONITOR_WEBHOOK_URL``.
        min_severity: the least severe alert posted (``"info"``, ``"warning"`` or ``"critical"``).
        timeout: seconds one HTTP request may take (> 0), from connecting to the end of the answer.
        retries: further attempts after a failed post.
        backoff: seconds before the first retry, doubled at each further one (capped at 60 s).
        max_queue: alerts waiting to be posted at most; when full, the oldest is dropped and counted
            in :attr:`dropped`.
        flush_timeout: seconds the end of the fit waits at most for the queue to drain.
        title: prefix of every message (e.g. the experiment's name).

    Attributes:
        sent: alerts delivered. failed: alerts given up (after the retries, where the error is worth retrying).
        dropped: alerts dropped from a full queue (each over the sink's life; the warning at the end of a fit counts
        that fit's). last_error: the last delivery error of the current or last fit, if any.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        min_severity: str = "warning",
        timeout: float = 5.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_queue: int = 100,
        flush_timeout: float = 10.0,
        title: str = "lightning-monitor",
    ) -> None:
        super().__init__()
        if min_severity not in SEVERITY_LEVELS:
            raise ValueError(f"`min_severity` must be one of {sorted(SEVERITY_LEVELS)}, got {min_severity!r}.")
        # a timeout of 0 makes the socket non-blocking: every post would fail ("operation now in progress")
        check_positive("timeout", timeout)
        check_nonnegative("backoff", backoff)
        check_nonnegative("flush_timeout", flush_timeout)
        for name, value, least in (("retries", retries, 0), ("max_queue", max_queue, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"`{name}` must be an int >= {least}, got {value!r}.")
        if url is not None and not isinstance(url, str):
            raise TypeError(f"`url` must be a string (an http:// or https:// address) or None, got {url!r}.")
        self.url = url or os.environ.get(ENV_VAR) or None
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"The webhook URL must start with http:// or https://, got {self.url!r}.")
        self.min_severity = min_severity
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.max_queue = max_queue
        self.flush_timeout = float(flush_timeout)
        self.title = title
        self.sent = self.failed = self.dropped = 0
        self.last_error: Optional[str] = None
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._queue: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False  # a post is in flight
        self._thread: Optional[threading.Thread] = None
        self._hub: Optional[AlertHub] = None
        self._finished = True
        self._warned_full = False

    # a Trainer travels to spawned processes pickled; the queue, lock and thread are made anew there
    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_queue", "_cond", "_busy", "_thread", "_hub", "_finished", "_warned_full")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        hub = AlertHub.for_trainer(trainer)  # on every rank: the hub chooses its run id collectively
        if trainer.global_rank != 0:
            return
        if not self.url:
            rank_zero_warn(f"AlertWebhook has no URL (pass `url` or set ${ENV_VAR}): alerts are not posted.")
            return
        self._hub = hub
        hub.subscribe(self)
        self._finished = False
        self._warned_full = False
        # the counts at the fit's start: its end says what this fit lost, not an earlier fit of the same sink
        with self._cond:
            self._at_start = (self.sent, self.failed, self.dropped)
            self.last_error = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish()

    def _finish(self) -> None:
        """Once per fit: stop listening, wait for the queue up to ``flush_timeout``, say what was lost."""
        if self._finished:
            return
        self._finished = True
        if self._hub is not None:
            self._hub.unsubscribe(self)
            self._hub = None
        drained = self.flush()
        with self._cond:
            pending = len(self._queue) + int(self._busy)
            sent0, failed0, dropped0 = getattr(self, "_at_start", (0, 0, 0))
            sent, failed, dropped = self.sent - sent0, self.failed - failed0, self.dropped - dropped0
        lost = [f"{failed} failed (retried up to {self.retries} times where the error was worth it)" if failed else "",
                f"{dropped} dropped from a full queue (max_queue={self.max_queue})" if dropped else "",
                f"{pending} still queued after flush_timeout={self.flush_timeout:g}s" if not drained else ""]
        lost = [part for part in lost if part]
        if lost:
            why = f"; last error: {self.last_error}" if self.last_error else ""
            log.warning("AlertWebhook: %d alert(s) posted, %s%s.", sent, ", ".join(lost), why)

    # ------------------------------------------------------------------ the sink
    def __call__(self, alert: Alert) -> None:
        """Queue ``alert`` if it is at least ``min_severity``; returns at once."""
        if SEVERITY_LEVELS[alert.severity] < SEVERITY_LEVELS[self.min_severity] or not self.url:
            return
        try:
            self.post(self.format(alert))
        except Exception as err:  # pragma: no cover - a sink never fails training
            self.last_error = repr(err)

    def format(self, alert: Alert) -> str:
        """The text posted for ``alert`` (Slack mrkdwn; Teams shows it as Markdown)."""
        where = f" on `{alert.layer}`" if alert.layer else ""
        run = f" (run {alert.run_id})" if alert.run_id else ""
        return (f"*{alert.severity.upper()}* [{self.title}] `{alert.monitor}/{alert.kind}`{where} at step "
                f"{alert.step}{run}: {alert.message}")

    def post(self, text: str) -> None:
        """Queue ``text`` for posting; when the queue is full the oldest entry is dropped and counted."""
        with self._cond:
            if len(self._queue) >= self.max_queue:
                self._queue.popleft()
                self.dropped += 1
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("AlertWebhook: the queue is full (max_queue=%d): dropping the oldest alerts.",
                                self.max_queue)
            self._queue.append(text)
            self._cond.notify_all()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drain, name="lightning-monitor-webhook", daemon=True)
                self._thread.start()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued alert was posted (or given up), at most ``timeout`` seconds
        (``flush_timeout`` by default); whether the queue drained."""
        deadline = time.monotonic() + (self.flush_timeout if timeout is None else timeout)
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _drain(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                text = self._queue.popleft()
                self._busy = True
            delivered = False
            try:
                delivered = self._send(text)
            except Exception as err:  # noqa: BLE001 - the sender outlives any error: counted, never raised
                self.last_error = repr(err)
            finally:
                with self._cond:
                    self._busy = False
                    if delivered:
                        self.sent += 1
                    else:
                        self.failed += 1
                    self._cond.notify_all()

    def _send(self, text: str) -> bool:
        """POST ``{"text": text}`` with retries and exponential backoff; whether it was delivered."""
        body = json.dumps({"text": text}).encode("utf-8")
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 60.0))
            request = urllib.request.Request(
                self.url, data=body, method="POST",
                headers={"Content-Type": "application/json", "User-Agent": "lightning-monitor"},
            )
            try:
                with _OPENER.open(request, timeout=self.timeout):
                    pass  # a 2xx status: delivered (its body, which a slow server may trickle, is not waited for)
                return True
            except urllib.error.HTTPError as err:
                self.last_error = f"HTTP {err.code} {err.reason}"
                if 300 <= err.code < 400:
                    where = err.headers.get("Location") if err.headers is not None else None
                    self.last_error += (f" to {where!r}" if where else "") + (
                        ": redirects are not followed (a POST redirected by 301, 302 or 303 arrives as a GET without "
                        "its body, and the alert would be lost though the post looked delivered); give the sink the "
                        "address the server redirects to")
                if err.code < 500 and err.code not in _RETRY_STATUSES:
                    return False
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as err:
                # refused, unreachable, timed out; an answer cut short or not HTTP (IncompleteRead, BadStatusLine)
                self.last_error = (f"{type(err).__name__}: {err!r}" if isinstance(err, http.client.HTTPException)
                                   else str(getattr(err, "reason", err)))
        return False
