"""The ``chorus`` command: serve, models prepare / list, bench."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

from server.config import ConfigError, Settings, load_config


def _config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    try:
        return load_config(args.config)
    except ConfigError as exc:
        sys.exit(f"chorus: {exc}")


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


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engines.errors import GatewayError
    from engines.prepare import is_prepared, prepare_model
    from server.app import create_app

    config = _config(args)
    env = Settings()
    host = args.host or env.host or config.server.host
    port = args.port if args.port is not None else (env.port if env.port is not None else config.server.port)
    for spec in config.models:
        if spec.needs_prepare and args.no_prepare and not is_prepared(spec.prepared_dir()):
            sys.exit(f"chorus: model {spec.name!r} is not prepared; run: chorus models prepare {spec.name}")
        try:
            prepare_model(spec, models={m.name: m for m in config.models})
        except GatewayError as exc:
            sys.exit(f"chorus: cannot prepare {spec.name}: {exc.message}")
    configure_logging(config.server.log.json_format, args.log_level or config.server.log.level)
    app = create_app(config)
    if not app.state.keys.enabled and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"chorus: no API keys are configured, so chorus binds to 127.0.0.1 only (not {host}); add keys under "
              "auth.keys (chorus keys hash) or CHORUS_API_KEYS to serve other hosts", file=sys.stderr, flush=True)
        host = "127.0.0.1"
    elif not app.state.keys.enabled:
        print("chorus: no API keys configured: open to local clients only (127.0.0.1)", file=sys.stderr, flush=True)
    print(f"chorus: serving {', '.join(m.name for m in config.models)} on http://{host}:{port}/v1", flush=True)

    grace = config.server.shutdown_grace_s

    class Server(uvicorn.Server):
        """SIGTERM: stop admitting (/health 503 draining, /v1 503), let in-flight requests finish for up to
        ``shutdown_grace_s``, then stop (uvicorn cancels what is left). A second signal stops at once."""

        def handle_exit(self, sig: int, frame: object) -> None:
            door = app.state.door
            if door.draining:
                super().handle_exit(sig, frame)  # type: ignore[arg-type]
                return
            door.draining = True
            print(f"chorus: draining: {door.inflight} request(s) in flight, up to {grace:g} s", file=sys.stderr,
                  flush=True)

            def drain() -> None:
                deadline = time.monotonic() + grace
                while door.inflight > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                super(Server, self).handle_exit(sig, frame)  # type: ignore[arg-type]

            threading.Thread(target=drain, name="chorus-drain", daemon=True).start()

    Server(uvicorn.Config(app, host=host, port=port, log_level=args.log_level or config.server.log.level,
                          access_log=False, timeout_graceful_shutdown=max(1, int(grace)),
                          log_config=None)).run()
    return 0


def cmd_keys_hash(args: argparse.Namespace) -> int:
    import getpass
    import secrets

    from server.auth import hash_key

    raw = args.key or (secrets.token_urlsafe(32) if args.generate else getpass.getpass("API key: "))
    if args.generate and not args.key:
        print(f"key:    {raw}   (give this to the client; it is not stored)")
    print(f"sha256: {hash_key(raw)}")
    return 0


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from engines.errors import GatewayError
    from engines.prepare import prepare_model

    config = _config(args)
    names = args.names or [m.name for m in config.models]
    known = {m.name for m in config.models}
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"chorus: unknown model(s) {', '.join(unknown)}; the config has: {', '.join(sorted(known))}")
    failed = 0
    for name in names:
        try:
            prepare_model(config.model(name), force=args.force, models={m.name: m for m in config.models})
        except GatewayError as exc:
            print(f"{name}: FAILED: {exc.message}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from engines.prepare import is_prepared
    from engines.spec import chorus_home

    config = _config(args)
    home = chorus_home()
    print(f"{'name':28} {'engine':12} {'device':7} {'state':12} location")
    for m in config.models:
        d = m.checkpoint_dir(home)
        if m.engine == "fake":
            state = "built-in"
        elif m.needs_prepare:
            state = "prepared" if is_prepared(d) else "not prepared"
        else:
            state = "local" if (d / "config.json").is_file() else "missing"
        print(f"{m.name:28} {m.engine:12} {m.device:7} {state:12} {d if m.engine != 'fake' else '-'}")
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from clients.bench_engine import main as bench

    return bench(args)


def cmd_bench_ensembles(args: argparse.Namespace) -> int:
    from clients.bench_ensembles import main as bench

    return bench(args)


def cmd_bench_load(args: argparse.Namespace) -> int:
    from clients.bench_load import main as bench

    return bench(args)


def cmd_bench_gateway(args: argparse.Namespace) -> int:
    from clients.bench_gateway import main as bench

    return bench(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from clients.eval import main as run_eval

    return run_eval(args)


def cmd_route_calibrate(args: argparse.Namespace) -> int:
    from clients.route_calibrate import main as run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chorus", description="OpenAI-compatible LLM gateway with ensembles")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--config", help="config YAML (default: $CHORUS_CONFIG or the packaged default)")
        return sp

    s = with_config(sub.add_parser("serve", help="run the gateway"))
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--log-level", help="default: server.log.level in the config")
    s.add_argument("--no-prepare", action="store_true", help="fail instead of preparing missing models")
    s.set_defaults(func=cmd_serve)
    w = with_config(sub.add_parser("worker", help="serve the config's models as a worker behind a gateway "
                                                  "(the same OpenAI API)"))
    w.add_argument("--host")
    w.add_argument("--port", type=int)
    w.add_argument("--log-level")
    w.add_argument("--no-prepare", action="store_true")
    w.set_defaults(func=cmd_serve)

    from server.cli_families import add_family_commands

    add_family_commands(sub)
    m = sub.add_parser("models", help="prepare and list models").add_subparsers(dest="models_cmd", required=True)
    mp = with_config(m.add_parser("prepare", help="convert packaged / GGUF models into the cache"))
    mp.add_argument("names", nargs="*", help="models to prepare (default: all in the config)")
    mp.add_argument("--force", action="store_true", help="rebuild even when prepared")
    mp.set_defaults(func=cmd_models_prepare)
    ml = with_config(m.add_parser("list", help="models in the config and their state"))
    ml.set_defaults(func=cmd_models_list)

    b = sub.add_parser("bench", help="benchmarks that print tables").add_subparsers(dest="bench_cmd", required=True)
    be = with_config(b.add_parser("engine", help="decode throughput: chorus engine vs model.generate()"))
    be.add_argument("--model", default="smollm2-135m-instruct")
    be.add_argument("--tokens", type=int, default=128)
    be.add_argument("--concurrency", type=int, default=8)
    be.add_argument("--threads", type=int, default=2)
    be.add_argument("--rounds", type=int, default=3)
    be.add_argument("--skip-transformers-serve", action="store_true")
    be.set_defaults(func=cmd_bench_engine)
    from clients.bench_ensembles import add_arguments

    bs = with_config(b.add_parser("ensembles", help="ensemble overheads: logit averaging, ROUGE-L scoring, concurrency"))
    add_arguments(bs)
    bs.set_defaults(func=cmd_bench_ensembles)
    from clients.bench_load import add_arguments as load_arguments

    bl = with_config(b.add_parser("load", help="N clients for T seconds: outcomes, errors, p99, memory"))
    load_arguments(bl)
    bl.set_defaults(func=cmd_bench_load)
    from clients.bench_families import add_arguments as families_arguments, run as bench_families

    bf = with_config(b.add_parser("families", help="MoDr routing overhead and KV cache, MoE vs dense"))
    families_arguments(bf)
    bf.set_defaults(func=bench_families)
    from clients.bench_gateway import add_arguments as gateway_arguments

    bg = b.add_parser("gateway", help="gateway overhead vs direct (and LiteLLM) on a mock upstream, with wrk")
    gateway_arguments(bg)
    bg.set_defaults(func=cmd_bench_gateway)

    from clients.eval import add_arguments as eval_arguments

    ev = with_config(sub.add_parser("eval", help="accuracy of models and ensembles on a JSONL dataset, side by side"))
    eval_arguments(ev)
    ev.set_defaults(func=cmd_eval)

    from clients.route_calibrate import add_arguments as calibrate_arguments

    r = sub.add_parser("route", help="routing tools").add_subparsers(dest="route_cmd", required=True)
    rc = with_config(r.add_parser("calibrate", help="cost-router thresholds for target shares of calls"))
    calibrate_arguments(rc)
    rc.set_defaults(func=cmd_route_calibrate)
    k = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys_cmd", required=True)
    kh = k.add_parser("hash", help="print the SHA-256 to put under auth.keys (the raw key is never stored)")
    kh.add_argument("--key", help="the key (default: prompt for it)")
    kh.add_argument("--generate", action="store_true", help="make a new random key")
    kh.set_defaults(func=cmd_keys_hash)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
