"""``chorus serve`` and ``chorus worker``: the gateway (a worker is the same server behind a gateway)."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import threading
import time

from chorus.config import ChorusConfig, ConfigError, Settings, load_config


def config_of(args: argparse.Namespace) -> ChorusConfig:
    """The command's ``--config`` (or the default), or exit with the config error."""
    try:
        return load_config(args.config)
    except ConfigError as exc:
        sys.exit(f"chorus: {exc}")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--log-level", help="default: server.log.level in the config")
    p.add_argument("--no-prepare", action="store_true", help="fail instead of preparing missing models")


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


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from chorus.engines.core.registry import engine_kind, not_ready, prepare_model
    from chorus.errors import GatewayError
    from chorus.server.app import create_app
    from chorus.server.gateway.services import services_of

    config = config_of(args)
    env = Settings()
    host = args.host or env.host or config.server.host
    port = args.port if args.port is not None else (env.port if env.port is not None else config.server.port)
    config, skipped = config.served(not_ready)
    for line in skipped:
        print(f"chorus: {line}", file=sys.stderr, flush=True)
    if not config.models:
        sys.exit("chorus: no model to serve: every model of the config is optional and none is prepared")
    for spec in config.models:
        if spec.needs_prepare and args.no_prepare and not_ready(spec):
            sys.exit(f"chorus: model {spec.name!r} is not prepared; run: chorus models prepare {spec.name}")
        try:
            prepare_model(spec, models={m.name: m for m in config.models})
        except GatewayError as exc:
            sys.exit(f"chorus: cannot prepare {spec.name}: {exc.message}")
    configure_logging(config.server.log.json_format, args.log_level or config.server.log.level)
    if all(engine_kind(m.engine).light for m in config.models):  # no torch forward in this process
        # llama.cpp's threads own the cores; torch only mixes and samples 1-D rows here, and a torch team
        # spinning after each op slowed them (measured: two-member logit_average 35 -> 45-52 tok/s)
        import torch

        torch.set_num_threads(1)
    app = create_app(config)
    services = services_of(app)
    if not services.keys.enabled and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"chorus: no API keys are configured, so chorus binds to 127.0.0.1 only (not {host}); add keys under "
              "auth.keys (chorus keys hash) or CHORUS_API_KEYS to serve other hosts", file=sys.stderr, flush=True)
        host = "127.0.0.1"
    elif not services.keys.enabled:
        print("chorus: no API keys configured: open to local clients only (127.0.0.1)", file=sys.stderr, flush=True)
    served = [m.name for m in config.models] + [e.name for e in config.ensembles]
    print(f"chorus: serving {', '.join(served)} on http://{host}:{port}/v1", flush=True)

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
            print(f"chorus: draining: {admission.inflight} request(s) in flight, up to {grace:g} s", file=sys.stderr,
                  flush=True)

            def drain() -> None:
                deadline = time.monotonic() + grace
                while admission.inflight > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                super(Server, self).handle_exit(sig, frame)  # type: ignore[arg-type]

            threading.Thread(target=drain, name="chorus-drain", daemon=True).start()

    # Everything loaded so far (torch, models, tokenizers) lives as long as the process: frozen out of the
    # collector's generations, a full collection no longer walks it (measured: chorus bench gateway, c=32).
    gc.collect()
    gc.freeze()
    Server(uvicorn.Config(app, host=host, port=port, log_level=args.log_level or config.server.log.level,
                          access_log=False, timeout_graceful_shutdown=max(1, int(grace)),
                          log_config=None)).run()
    return 0


