"""SIGTERM on a real ``batchpilot serve`` subprocess: admission stops (503 + Retry-After, /health 503
"draining"), everything accepted before the signal is answered, the process exits 0.

What holds the drain open is the test's own upload: a request whose body has begun (so it is in flight)
and is finished only once the test has seen the draining server answer. The test waits on the server's
own metrics, never on sleeps, and nothing depends on how fast the model is.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from inproc import free_port, scrape, wait_for

ACCEPTED = 4


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    log_path = tmp_path / "serve.log"
    cfg = tmp_path / "sched.yaml"  # one input per batch; an explicit queue bound with room for the test
    cfg.write_text("encoder:\n  policy: {name: window, max_batch_size: 1, max_wait_s: 0.0}\n"
                   "  admission: {max_queued_requests: 16}\n")
    cmd = [sys.executable, "-m", "batchpilot.cli", "serve", "--port", str(port), "--noop", "--no-warmup",
           "--config", str(cfg), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, timeout_s=120, what="server ready")
    return proc, url, log_path


def test_sigterm_stops_admission_drains_in_flight_work_and_exits_0(tmp_path: Path) -> None:
    proc, url, log_path = start(tmp_path, "--noop-delay-ms", "300", "--drain-timeout-s", "60",
                                "--body-timeout-s", "120")
    body = b'{"input": "uploaded across the signal"}'
    upload = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=60)
    try:
        upload.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        # in flight, before anything else is sent: the upload (one body byte is enough) and this scrape
        wait_for(lambda: scrape(url)["batchpilot_http_in_flight"] == 2, what="the upload in flight")
        with concurrent.futures.ThreadPoolExecutor(ACCEPTED) as pool:
            accepted = [pool.submit(httpx.post, url + "/v1/embeddings", json={"input": f"accepted {i}"},
                                    timeout=60) for i in range(ACCEPTED)]

            def admitted() -> float:  # still pending or already answered: however fast the machine is
                m = scrape(url)
                return m["batchpilot_pending_requests"] + m.get(
                    "batchpilot_http_requests_total{route=/v1/embeddings,status=200}", 0.0)

            wait_for(lambda: admitted() == ACCEPTED, what="all accepted")
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, what="draining")
            health = httpx.get(url + "/health", timeout=5)
            assert health.json()["status"] == "draining" and int(health.headers["Retry-After"]) >= 1
            late = httpx.post(url + "/v1/embeddings", json={"input": "too late"}, timeout=10)
            assert late.status_code == 503, late.text
            err = late.json()["error"]
            assert err["code"] == "shutting_down" and int(late.headers["Retry-After"]) >= 1
            assert proc.poll() is None  # still draining: the upload is not finished
            upload.sendall(body[5:])
            answer = upload.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]  # begun before the signal: served
            results = [f.result() for f in accepted]
        assert [r.status_code for r in results] == [200] * ACCEPTED  # nothing accepted is lost
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        upload.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_timeout_bounds_the_shutdown_and_answers_the_rest(tmp_path: Path) -> None:
    """A drain that cannot finish in time still ends: what is left gets a 503 (not a hang), exit 1."""
    proc, url, log_path = start(tmp_path, "--noop-delay-ms", "2000", "--drain-timeout-s", "1")
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            accepted = [pool.submit(httpx.post, url + "/v1/embeddings", json={"input": f"slow {i}"},
                                    timeout=60) for i in range(3)]
            wait_for(lambda: scrape(url)["batchpilot_pending_requests"] == 3, what="all accepted")
            proc.send_signal(signal.SIGTERM)
            codes = []
            for f in accepted:
                try:
                    codes.append(f.result().status_code)
                except httpx.HTTPError as exc:  # the connection closed by the forced shutdown
                    codes.append(type(exc).__name__)
        assert proc.wait(timeout=60) == 1, log_path.read_text()[-3000:]
        assert codes.count(200) < 3 and set(codes) <= {200, 503}, codes  # the rest answered, not dropped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_llm_stream_past_the_drain_timeout_ends_with_an_error_event_not_a_cut(tmp_path: Path) -> None:
    """The drain cannot wait for a long generation: when it times out the engine is stopped and the open
    stream gets an SSE error event before its connection closes, and the exit status says so (1)."""
    import json

    proc, url, log_path = start(tmp_path, "--llm", "--drain-timeout-s", "1")
    try:
        body = {"prompt": "tell me a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 1:  # it is generating: now ask the server to stop
                    proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1, log_path.read_text()[-3000:]
        assert events[-1] != "[DONE]" and "error" in json.loads(events[-1]), events[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
