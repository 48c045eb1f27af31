"""A separate process that receives OTLP over HTTP (POST /v1/traces, protobuf), decodes each export with
OpenTelemetry's own protobuf types, and appends one JSON line per span to a file: the collector side of the trace
tests (``python -m tests.otlp_receiver PORT FILE``)."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else None


class Receiver(BaseHTTPRequestHandler):
    out = ""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        req = ExportTraceServiceRequest.FromString(body)
        with open(self.out, "a") as f:
            for rs in req.resource_spans:
                service = {a.key: value(a.value) for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        f.write(json.dumps({"service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                                            "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                            "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                            "attributes": {a.key: value(a.value) for a in s.attributes}}) + "\n")
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    Receiver.out = sys.argv[2]
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Receiver).serve_forever()
