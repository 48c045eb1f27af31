"""``chorus batch``: submit a JSONL of requests to a server's Batch API, follow it with a progress bar, download
its output (and error) file. Speaks only HTTP, through the openai SDK, so it works against any server with
OpenAI's Batch API: chorus, OpenAI, LiteLLM's proxy.

    chorus batch run requests.jsonl --url http://127.0.0.1:8000 --out answers.jsonl
    chorus batch status batch_abc   |   chorus batch cancel batch_abc   |   chorus batch download batch_abc --out a.jsonl

``run`` reads the endpoint from the file's first line's ``url``; Ctrl-C while following leaves the batch running
(``chorus batch status`` / ``download`` pick it up later); ``--cancel-on-interrupt`` cancels it instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

FINAL = ("completed", "failed", "expired", "cancelled")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("CHORUS_URL", "http://127.0.0.1:8000"),
                   help="the server (default $CHORUS_URL or http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                   help="the key (default $OPENAI_API_KEY)")
    sub = p.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="upload a JSONL of requests, create the batch, follow it, download its output")
    run.add_argument("input", type=Path, help="one request a line: {custom_id, method: POST, url, body}")
    run.add_argument("--out", type=Path, help="where the output file goes (default: INPUT.out.jsonl)")
    run.add_argument("--window", default="24h", help="completion_window (default 24h)")
    run.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--no-follow", action="store_true", help="print the batch's id and return")
    run.add_argument("--cancel-on-interrupt", action="store_true")
    for name, helptext in (("status", "print a batch"), ("cancel", "cancel a batch"),
                           ("download", "download a finished batch's output and error files")):
        one = sub.add_parser(name, help=helptext)
        one.add_argument("batch_id")
        if name == "download":
            one.add_argument("--out", type=Path, required=True)


def main(args: argparse.Namespace) -> int:
    import openai

    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=3)
    try:
        if args.action == "run":
            return submit(client, args)
        if args.action == "status":
            print(json.dumps(client.batches.retrieve(args.batch_id).model_dump(), indent=2))
            return 0
        if args.action == "cancel":
            print(client.batches.cancel(args.batch_id).status)
            return 0
        return download(client, client.batches.retrieve(args.batch_id), args.out)
    except openai.APIStatusError as exc:
        print(f"chorus batch: {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    except openai.APIConnectionError as exc:
        print(f"chorus batch: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1


def endpoint_of(path: Path) -> str:
    with path.open() as f:
        for raw in f:
            if raw.strip():
                url = json.loads(raw).get("url")
                if isinstance(url, str):
                    return url
                break
    raise SystemExit(f"chorus batch: {path}'s first line has no url (the endpoint, e.g. /v1/chat/completions)")


def submit(client: Any, args: argparse.Namespace) -> int:
    if not args.input.is_file():
        print(f"chorus batch: no such file: {args.input}", file=sys.stderr)
        return 2
    metadata = dict(m.partition("=")[::2] for m in args.metadata) or None
    with args.input.open("rb") as f:
        batch = create(client, (args.input.name, f), endpoint_of(args.input), args.window, metadata)
    print(batch.id)
    if args.no_follow:
        return 0
    try:
        batch = follow(client, batch.id)
    except KeyboardInterrupt:
        if args.cancel_on_interrupt:
            print(f"\ncancelling {batch.id}: {client.batches.cancel(batch.id).status}", file=sys.stderr)
        else:
            print(f"\n{batch.id} goes on; `chorus batch download {batch.id} --out FILE` when it is done",
                  file=sys.stderr)
        return 130
    return download(client, batch, args.out or args.input.with_suffix(".out.jsonl"))


def create(client: Any, file: tuple[str, Any], endpoint: str, window: str = "24h",
           metadata: dict[str, str] | None = None) -> Any:
    """Upload ``file`` (a name and its bytes or an open file) with purpose ``batch`` and create its batch."""
    uploaded = client.files.create(file=file, purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window=window,
                                 metadata=metadata)


def rows(client: Any, batch: Any) -> list[dict[str, Any]]:
    """A finished batch's output and error files, line by line (OpenAI's format: custom_id, response, error)."""
    return [json.loads(line) for file_id in (batch.output_file_id, batch.error_file_id) if file_id
            for line in client.files.content(file_id).text.splitlines()]


def follow(client: Any, batch_id: str, every: float = 1.0) -> Any:
    """Poll until the batch ends, with a progress bar of its lines (tqdm, on stderr)."""
    from tqdm import tqdm

    with tqdm(desc=batch_id, unit="req", file=sys.stderr) as bar:
        while True:
            batch = client.batches.retrieve(batch_id)
            counts = batch.request_counts
            if counts is not None and counts.total:
                bar.total = counts.total
                bar.n = counts.completed + counts.failed
            bar.set_postfix_str(batch.status)
            bar.refresh()
            if batch.status in FINAL:
                return batch
            time.sleep(every)


def download(client: Any, batch: Any, out: Path) -> int:
    """Write the output file to ``out`` and the error file beside it; 0 if the batch completed with no error."""
    if batch.status not in FINAL:
        print(f"chorus batch: {batch.id} is {batch.status}; nothing to download yet", file=sys.stderr)
        return 1
    for reason in (batch.errors.data if batch.errors else []):
        where = f" (line {reason.line})" if reason.line else ""
        print(f"{reason.code}{where}: {reason.message}", file=sys.stderr)
    for file_id, path in ((batch.output_file_id, out), (batch.error_file_id, out.with_suffix(".errors.jsonl"))):
        if file_id:
            path.write_bytes(client.files.content(file_id).content)
            print(f"{path}", file=sys.stderr)
    counts = batch.request_counts
    print(f"{batch.id}: {batch.status}, {counts.completed} answered, {counts.failed} failed of {counts.total}",
          file=sys.stderr)
    return 0 if batch.status == "completed" and not batch.error_file_id else 1
