"""``chorus serve`` and ``chorus worker``: the gateway (a worker is the same server behind a gateway)."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import threading
import time
from typing import TextIO

from chorus.config import ChorusConfig, ConfigError, Settings, load_config


def config_of(args: argparse.Namespace) -> ChorusConfig:
    """The command's ``--config`` (or the default), or exit with the config error."""
    try:
        return load_config(args.config)
    except ConfigError as exc:
        sys.exit(f"chorus: {exc}")


def models_named(config: ChorusConfig, items: list[str]) -> ChorusConfig:
    """``--model [NAME=]SOURCE``: serve these models instead of the config's models and ensembles (its server
    settings kept), as ``vllm serve ORG/REPO`` does. SOURCE is a hub id (``hf:ORG/REPO``, ``hf:ORG/REPO:QUANT``,
    ``hf:ORG/REPO/FILE.gguf``), a checkpoint directory, a ``.gguf`` file or a packaged source; a GGUF runs on
    llama.cpp where llama-cpp-python is installed, else dequantized on the transformers engine. The name
    defaults to the repository (``ORG/REPO``, with ``:QUANT``) or the file's stem."""
    import importlib.util
    from pathlib import Path

    from chorus.engines.core import hub
    from chorus.engines.core.spec import ModelSpec

    gguf_engine = "llama_cpp" if importlib.util.find_spec("llama_cpp") is not None else "transformers"
    models = []
    for item in items:
        name, _, source = item.partition("=") if "=" in item else ("", "", item)
        entry: dict[str, str]
        if hub.is_hub(source):
            try:
                ref = hub.parse(source)
            except ValueError as exc:
                sys.exit(f"chorus: --model {item!r}: {exc}")
            entry = {"source": source, "engine": gguf_engine if ref.names_file else "transformers"}
            name = name or ref.repo + (f":{ref.quant}" if ref.quant else "")
        elif source.startswith(("pypi:", "pypi-parts:")):
            entry = {"source": source}
            name = name or source.split(":", 1)[1]
        else:
            path = Path(source).expanduser()
            if not path.exists():
                sys.exit(f"chorus: --model {item!r}: no such file or directory, and not a source (hf:ORG/REPO, "
                         "pypi:...)")
            entry = {"path": str(path), "engine": gguf_engine if path.suffix == ".gguf" else "transformers"}
            name = name or path.stem
        try:
            models.append(ModelSpec.model_validate({"name": name, **entry}))
        except ValueError as exc:
            sys.exit(f"chorus: --model {item!r}: {exc}")
    return config.model_copy(update={"models": models, "ensembles": []})


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", metavar="[NAME=]SOURCE",
                   help="serve this model instead of the config's models and ensembles (repeatable): hf:ORG/REPO, "
                        "hf:ORG/REPO:QUANT, hf:ORG/REPO/FILE.gguf, a checkpoint directory or a .gguf file")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--log-level", help="default: server.log.level in the config")
    p.add_argument("--no-prepare", action="store_true", help="fail instead of preparing missing models")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="serve from N processes on one port (remote-only configs; per-key state in Redis)")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # one of --workers' processes


def several_processes_refused(config: ChorusConfig, n: int) -> str | None:
    """Why ``config`` cannot be served by ``n`` processes, or None. Each process would load its own copy of an
    in-process model; and what is counted per key (limits, budgets, spend), the requests kept for feedback and the
    online routers' state must be shared, so they need ``server.state.store`` in Redis."""
    from chorus.engines.core.registry import engine_kind

    local = [m.name for m in config.models if engine_kind(m.engine).in_process]
    if local:
        return (f"--workers {n} serves remote-only configs, and {', '.join(local)} run(s) in this process (each of "
                f"the {n} would load its own copy): serve them on workers (engine: remote), or run one process")
    if config.server.state.store == "memory" and (config.auth.keys or config.server.feedback.metrics):
        return (f"--workers {n} with API keys or feedback needs the state shared: set server.state.store to a "
                "Redis URL (redis://...), or each process would count its own limits, budgets and spend")
    return None


def supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """``--workers N``: N copies of this server on one port (SO_REUSEPORT: the kernel spreads connections); a
    signal is passed on to each (each drains as one would), and the first to exit ends the rest."""
    import signal
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-m", "chorus", "serve", *argv, "--workers", "1", "--reuse-port"])
             for _ in range(args.workers)]
    signals: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        signals.append(sig)  # (a second one reaches the processes too: they stop at once)
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while all(p.poll() is None for p in procs):
        time.sleep(0.2)
    if not signals:  # one process ended by itself: the others follow
        forward(signal.SIGTERM, None)
    codes = [p.wait() for p in procs]  # (uvicorn re-raises the signal it stopped on: -SIGTERM is a clean stop)
    return next((c for c in codes if c != 0 and -c not in signals), 0)


def configure_logging(json_format: bool, level: str) -> None:
    """One JSON object per line (request id, status, latency, key, model, usage) or plain text."""
    handler = logging.StreamHandler()
    if json_format:
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                           rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def say(line: str, stream: TextIO | None = None) -> None:
    """One line to stderr (or ``stream``) that never raises: a stream that cannot take it (a log on a full disk)
    loses the line, never the server (a SIGTERM whose line raised would not stop it)."""
    try:
        print(line, file=stream or sys.stderr, flush=True)
    except OSError:
        pass


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from chorus.engines.core.registry import engine_kind, not_ready, prepare_model
    from chorus.errors import GatewayError
    from chorus.server.app import create_app
    from chorus.server.gateway.services import services_of

    from .allocator import tune

    allocator = tune()  # before any thread allocates: the arenas are capped for threads started from here on
    config = config_of(args)
    if args.model:
        config = models_named(config, args.model)
    env = Settings()
    host = args.host or env.host or config.server.host
    port = args.port if args.port is not None else (env.port if env.port is not None else config.server.port)
    config, skipped = config.served(not_ready)
    for line in skipped:
        say(f"chorus: {line}")
    if not config.models:
        sys.exit("chorus: no model to serve: every model of the config is optional and none is prepared")
    if args.workers < 1:
        sys.exit("chorus: --workers must be at least 1")
    if args.workers > 1:
        refused = several_processes_refused(config, args.workers)
        if refused:
            sys.exit(f"chorus: {refused}")
        return supervise(args, ["--host", host, "--port", str(port), "--no-prepare",  # (prepared above)
                                *(["--config", args.config] if args.config else []),
                                *[a for m in args.model or [] for a in ("--model", m)],
                                *(["--log-level", args.log_level] if args.log_level else [])])
    for spec in config.models:
        if spec.needs_prepare and args.no_prepare and not_ready(spec):
            sys.exit(f"chorus: model {spec.name!r} is not prepared; run: chorus models prepare {spec.name}")
        try:
            prepare_model(spec, models={m.name: m for m in config.models}, log=lambda line: say(line, sys.stdout))
        except GatewayError as exc:
            sys.exit(f"chorus: cannot prepare {spec.name}: {exc.message}")
    configure_logging(config.server.log.json_format, args.log_level or config.server.log.level)
    if allocator:
        logging.getLogger("chorus.server").info(
            "glibc allocator: %s", ", ".join(f"{k.strip('_')}={v}" for k, v in allocator.items()))
    if all(engine_kind(m.engine).light for m in config.models):  # no torch forward in this process
        # llama.cpp's threads own the cores; torch only mixes and samples 1-D rows here, and a torch team
        # spinning after each op slowed them (measured: two-member logit_average 35 -> 45-52 tok/s)
        import torch

        torch.set_num_threads(1)
    try:
        app = create_app(config)
    except ConfigError as exc:  # (CHORUS_API_KEYS is read here)
        sys.exit(f"chorus: {exc}")
    services = services_of(app)
    if not services.keys.enabled and host not in ("127.0.0.1", "localhost", "::1"):
        say(f"chorus: no API keys are configured, so chorus binds to 127.0.0.1 only (not {host}); add keys under "
            "auth.keys (chorus keys hash) or CHORUS_API_KEYS to serve other hosts")
        host = "127.0.0.1"
    elif not services.keys.enabled:
        say("chorus: no API keys configured: open to local clients only (127.0.0.1)")
    served = [m.name for m in config.models] + [e.name for e in config.ensembles]
    say(f"chorus: serving {', '.join(served)} on http://{host}:{port}/v1", sys.stdout)

    grace = config.server.shutdown_grace_s

    class Server(uvicorn.Server):
        """SIGTERM: stop admitting (/health 503 draining, /v1 503), let in-flight requests finish for up to
        ``shutdown_grace_s``, then stop (uvicorn cancels what is left). A second signal stops at once."""

        def handle_exit(self, sig: int, frame: object) -> None:
            admission = services.admission
            if admission.draining:
                super().handle_exit(sig, frame)  # type: ignore[arg-type]
                return
            admission.draining = True

            def drain() -> None:
                deadline = time.monotonic() + grace
                while admission.inflight > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                super(Server, self).handle_exit(sig, frame)  # type: ignore[arg-type]

            threading.Thread(target=drain, name="chorus-drain", daemon=True).start()
            # said after the drain has started: a log that cannot be written (a full disk) never stops the stop
            say(f"chorus: draining: {admission.inflight} request(s) in flight, up to {grace:g} s")

    # Everything loaded so far (torch, models, tokenizers) lives as long as the process: frozen out of the
    # collector's generations, a full collection no longer walks it (measured: chorus bench gateway, c=32).
    gc.collect()
    gc.freeze()
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=args.log_level or config.server.log.level,
                                   access_log=False, timeout_graceful_shutdown=max(1, int(grace)), log_config=None))
    if args.reuse_port:  # one of --workers' processes: the port is shared, the kernel spreads connections
        import socket

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        server.run(sockets=[sock])
    else:
        server.run()
    return 0


