"""AlertWebhook against a local HTTP server: delivered when the server is up, training unharmed when it
is down or slow."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import lightning.pytorch as pl
import pytest

from lightning_monitor import Alert, Monitor
from lightning_monitor.webhook import ENV_VAR, AlertWebhook


class _Server:
    """A local webhook endpoint in a thread, recording every POST; ``delay`` holds each answer back
    (until the test ends), ``status`` is the HTTP status it answers with."""

    def __init__(self, delay: float = 0.0, status: int = 200) -> None:
        self.requests: list[tuple[dict, dict]] = []  # (headers, JSON body)
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                server.requests.append((dict(self.headers), json.loads(body)))
                if delay:
                    server.release.wait(delay)
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server_factory():
    servers = []

    def make(**kwargs) -> _Server:
        servers.append(_Server(**kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _closed_port_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connections are refused
    return f"http://127.0.0.1:{port}/hook"


class _Alerter(Monitor):
    """A warning condition from step 2 (critical from 4, cleared at 6) and, at step 3, ``burst`` one-off
    warnings at once."""

    name = "probe"

    def __init__(self, burst: int = 0) -> None:
        super().__init__(every_n_steps=1)
        self.burst = burst

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        sev = "critical" if step >= 4 else "warning"
        self.condition(step, "high", 2 <= step < 6, sev, f"high at {step}", value=float(step), threshold=2.0)
        if step == 3:
            for i in range(self.burst):
                self.alert(step, "burst", "warning", f"burst {i}", layer=f"layer.{i}")


def _fit(tmp_path, tiny_gpt, callbacks, steps=8):
    module, loader = tiny_gpt()
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    start = time.perf_counter()
    trainer.fit(module, loader)
    return trainer, time.perf_counter() - start


def test_server_up_receives_each_alert_at_or_above_min_severity(tmp_path, tiny_gpt, server_factory):
    server = server_factory()
    probe = _Alerter()
    hook = AlertWebhook(url=server.url, min_severity="warning", title="tiny-gpt")
    trainer, _ = _fit(tmp_path, tiny_gpt, [probe, hook])
    assert trainer.global_step == 8
    # the fit ended with a flush: every post has arrived; the clear (info) was not posted
    assert hook.sent == 2 and hook.failed == 0 and hook.dropped == 0
    assert len(server.requests) == 2
    for headers, body in server.requests:
        assert headers["Content-Type"] == "application/json"
        assert set(body) == {"text"}  # what Slack and Teams incoming webhooks accept
    texts = [body["text"] for _, body in server.requests]
    run_id = probe.hub.run_id
    assert texts[0] == f"*WARNING* [tiny-gpt] `probe/high` at step 2 (run {run_id}): high at 2"
    assert texts[1].startswith("*CRITICAL* [tiny-gpt] `probe/high` at step 4") and texts[1].endswith("high at 4")
    assert [a.kind for a in probe.hub.history] == ["high", "high", "high_cleared"]


def test_url_from_environment_and_use_without_trainer(server_factory, monkeypatch):
    server = server_factory()
    monkeypatch.setenv(ENV_VAR, server.url)
    hook = AlertWebhook(min_severity="info")
    assert hook.url == server.url
    hook(Alert(7, "guard", "stopped", "info", "Training stopped.", layer=None, run_id="r1"))
    assert hook.flush(timeout=10) and hook.sent == 1
    text = server.requests[0][1]["text"]
    assert text == "*INFO* [lightning-monitor] `guard/stopped` at step 7 (run r1): Training stopped."
    with pytest.raises(ValueError, match="min_severity"):
        AlertWebhook(server.url, min_severity="fatal")
    with pytest.raises(ValueError, match="http"):
        AlertWebhook("file:///etc/passwd")
    monkeypatch.delenv(ENV_VAR)
    assert AlertWebhook().url is None


def test_server_down_training_completes_and_losses_are_counted(tmp_path, tiny_gpt, caplog):
    # a burst of 6 warnings at step 3 into a queue of 2, while each failed post takes >= 0.2 s (one retry
    # after backoff): at least 6 - 2 queued - 1 in flight = 3 are dropped
    hook = AlertWebhook(url=_closed_port_url(), retries=1, backoff=0.2, timeout=1.0, max_queue=2, flush_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="lightning_monitor"):
        trainer, _ = _fit(tmp_path, tiny_gpt, [_Alerter(burst=6), hook])
    assert trainer.global_step == 8 and trainer.state.status == "finished"
    assert hook.sent == 0 and hook.failed >= 1 and hook.dropped >= 3
    assert hook.last_error and "refused" in hook.last_error.lower()
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AlertWebhook: 0 alert(s) posted")]
    assert len(summary) == 1 and "dropped from a full queue (max_queue=2)" in summary[0]
    assert any("the queue is full" in r.getMessage() for r in caplog.records)


def test_slow_server_does_not_block_training(tmp_path, tiny_gpt, server_factory):
    # the server answers after 60 s; each alert is only queued during training, and the end of the fit
    # waits flush_timeout=0.5 s at most
    server = server_factory(delay=60.0)
    hook = AlertWebhook(url=server.url, timeout=60.0, flush_timeout=0.5)
    probe = _Alerter()
    trainer, seconds = _fit(tmp_path, tiny_gpt, [probe, hook])
    assert trainer.global_step == 8
    assert seconds < 20.0, seconds  # a post in the training loop would have held it >= 60 s
    assert hook.sent == 0 and len(server.requests) >= 1  # the first post reached the server, still unanswered
    start = time.perf_counter()
    assert hook.flush(timeout=0.2) is False
    assert time.perf_counter() - start < 1.0


class _Redirecting:
    """A server that answers a POST to ``/old`` with ``status`` and ``Location: /new``, and records every request
    (method, path, body)."""

    def __init__(self, status: int) -> None:
        self.requests: list[tuple[str, str, bytes]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append((self.command, self.path, body))
                if self.path == "/old":
                    self.send_response(status)
                    self.send_header("Location", "/new")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET = _answer

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/old"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.mark.parametrize("status", [301, 302, 303, 307])
def test_a_redirect_fails_the_post_and_names_the_new_address(status):
    """``urllib`` follows a 301/302/303 answer to a POST with a GET without the body, which the new address answered
    with 200: the alert was lost and counted as sent. A redirect now fails the post (not retried), naming where it
    points."""
    server = _Redirecting(status)
    try:
        hook = AlertWebhook(server.url, min_severity="info", retries=2, backoff=0.0)
        hook(Alert(3, "guard", "stopped", "info", "Training stopped.", layer=None, run_id="r1"))
        assert hook.flush(timeout=10)
        assert (hook.sent, hook.failed) == (0, 1)
        assert hook.last_error is not None and str(status) in hook.last_error and "'/new'" in hook.last_error
        assert [(method, path) for method, path, _ in server.requests] == [("POST", "/old")]
        assert json.loads(server.requests[0][2])["text"].endswith("Training stopped.")
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


@pytest.mark.parametrize("kwargs, error", [
    (dict(timeout=0), "timeout"),  # a non-blocking socket: every post failed with "operation now in progress"
    (dict(timeout=float("nan")), "timeout"),
    (dict(flush_timeout=float("nan")), "flush_timeout"),
    (dict(backoff=float("inf")), "backoff"),
])
def test_bad_timeouts_are_refused_at_construction(kwargs, error):
    with pytest.raises(ValueError, match=error):
        AlertWebhook("http://127.0.0.1:9/hook", **kwargs)


def test_a_url_that_is_not_a_string_is_refused():
    with pytest.raises(TypeError, match="`url` must be a string"):
        AlertWebhook(5)


class _RawServer:
    """A socket server that reads one POST and answers with raw bytes: ``at_once``, then ``answer`` at once, or, with
    ``trickle``, one byte every ``trickle`` seconds (never idle for a whole read timeout)."""

    def __init__(self, answer: bytes, trickle: float = 0.0, at_once: bytes = b"") -> None:
        self.posts = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.answer, self.trickle, self.at_once = answer, trickle, at_once
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            while len(body) < length:  # the whole request read: the answer is what fails, not the connection
                body += conn.recv(65536)
            self.posts += 1
            conn.sendall(self.at_once)
            if not self.trickle:
                conn.sendall(self.answer)
            for byte in (self.answer if self.trickle else b""):
                conn.sendall(bytes([byte]))
                time.sleep(self.trickle)
        except OSError:
            pass
        finally:
            conn.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 70000 + b"\r\n\r\n",  # a header too long: http.client.LineTooLong
    b"garbage\r\n\r\n",  # no status line: http.client.BadStatusLine
])
def test_an_answer_that_is_not_http_counts_as_a_failed_post_and_the_sender_goes_on(answer):
    # http.client's own errors are no OSError: they escaped the sender thread, which died with a traceback, left the
    # sink "busy" for good (every fit's end then waited its whole flush_timeout) and counted the alert nowhere
    server = _RawServer(answer)
    hook = AlertWebhook(server.url, min_severity="info", retries=1, backoff=0.0, flush_timeout=5.0)
    for step in (1, 2):
        hook(Alert(step, "guard", "stopped", "info", "Training stopped.", layer=None, run_id="r1"))
    start = time.perf_counter()
    assert hook.flush()
    assert time.perf_counter() - start < 4.0
    assert (hook.sent, hook.failed) == (0, 2) and server.posts == 4  # each retried once
    assert hook.last_error is not None and ("LineTooLong" in hook.last_error or "BadStatusLine" in hook.last_error)


def test_a_post_answered_2xx_is_delivered_without_waiting_for_a_slow_body():
    # the status says the post was delivered; a body trickled one byte at a time (or cut short) is not waited for
    server = _RawServer(b"o" * 100, trickle=0.3, at_once=b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
    hook = AlertWebhook(server.url, min_severity="info", timeout=1.0, retries=0, flush_timeout=10.0)
    hook(Alert(1, "guard", "stopped", "info", "Training stopped.", layer=None, run_id="r1"))
    start = time.perf_counter()
    assert hook.flush()
    assert time.perf_counter() - start < 5.0 and (hook.sent, hook.failed) == (1, 0)


def test_the_timeout_bounds_a_whole_request():
    # a server that answers one byte every 0.3 s is never idle for the 1 s timeout of a read: the request held the
    # one sender thread for as long as the server liked, and every later alert waited behind it
    server = _RawServer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + b" " * 100, trickle=0.3)
    hook = AlertWebhook(server.url, min_severity="info", timeout=1.0, retries=0, flush_timeout=10.0)
    hook(Alert(1, "guard", "stopped", "info", "Training stopped.", layer=None, run_id="r1"))
    start = time.perf_counter()
    assert hook.flush()
    assert time.perf_counter() - start < 5.0 and (hook.sent, hook.failed) == (0, 1)


def test_the_end_of_a_fit_counts_that_fits_losses_only(tmp_path, tiny_gpt, server_factory, caplog):
    # one sink in two fits: the first fit's 404 was said again at the end of the second, which delivered everything,
    # and a 404 (never retried) was said to have failed "after 3 retries"
    missing = server_factory(status=404)
    hook = AlertWebhook(url=missing.url, backoff=0.0)
    with caplog.at_level(logging.WARNING, logger="lightning_monitor"):
        _fit(tmp_path / "one", tiny_gpt, [_Alerter(), hook])
        hook.url = server_factory().url
        _fit(tmp_path / "two", tiny_gpt, [_Alerter(), hook])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AlertWebhook:")]
    assert len(said) == 1 and said[0].startswith("AlertWebhook: 0 alert(s) posted, 2 failed")
    assert "HTTP 404" in said[0] and "after 3 retries" not in said[0]
    assert (hook.sent, hook.failed) == (2, 2) and hook.last_error is None
