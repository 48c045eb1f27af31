"""SIGTERM on a real `chorus serve` process: in-flight streams finish, new work is refused, then it exits."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from chorus.clients.local import free_port, wait_ready

CONFIG = """
server: {shutdown_grace_s: 20}
models:
  - {name: slow, engine: fake, fake: {delay: 0.02, max_model_len: 100000}}
"""


def test_sigterm_drains_in_flight_streams(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(url + "/health", proc, timeout=60, interval=0.2)
        body = {"model": "slow", "messages": [{"role": "user", "content": "q"}], "max_tokens": 100,
                "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                lines.append(line)
                if len(lines) == 3:  # mid-stream: one SIGTERM (a second one stops at once)
                    proc.send_signal(signal.SIGTERM)
                    time.sleep(0.3)
                    h = httpx.get(url + "/health", timeout=5)
                    assert h.status_code == 503 and h.json()["status"] == "draining"
                    refused = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=5)
                    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines)
        assert sum('"content"' in ln for ln in lines) >= 100  # the whole answer arrived
        assert proc.wait(timeout=30) == -signal.SIGTERM  # uvicorn re-raises the signal once it has drained
        out = proc.stdout.read() if proc.stdout else ""
        assert "draining: 1 request(s) in flight" in out
        assert '"logger": "chorus.access"' in out  # JSON access log lines
    except BaseException:
        proc.kill()
        print(proc.stdout.read() if proc.stdout else "")
        raise
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_log_that_cannot_be_written_neither_stops_the_server_nor_its_stop(tmp_path: Path) -> None:
    """stdout and stderr on a full disk (/dev/full: every write fails with ENOSPC): the server starts, answers and
    stops on one SIGTERM (its "draining" line once raised in the signal handler and the server never stopped)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--config", str(cfg), "--port", str(port)],
                                stdout=full, stderr=full)
    try:
        wait_ready(url + "/health", proc, timeout=60, interval=0.2)
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json={"model": "slow", "messages": [{"role": "user", "content": "q"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (-signal.SIGTERM, 120)  # (120: Python could not flush stdout at exit)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_metrics_report_the_latest_running_app_and_fall_back_when_it_stops() -> None:
    """The engine collector is per process: a second app (started after, stopped before) must not leave the first
    app's /metrics reporting the stopped app's engines."""
    import httpx

    from chorus.engines.fake.engine import FakeEngine
    from tests.helpers import serve_fakes

    with serve_fakes({"first-app-model": FakeEngine("first-app-model")}) as first:
        with serve_fakes({"second-app-model": FakeEngine("second-app-model")}):
            assert 'model="second-app-model"' in httpx.get(first.url + "/metrics").text
        text = httpx.get(first.url + "/metrics").text
        assert 'chorus_engine_active_sessions{model="first-app-model"}' in text and "second-app-model" not in text
