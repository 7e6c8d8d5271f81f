"""``observability.tracing.exporter: otlp`` end to end: ``tandem serve`` exports its spans over OTLP/HTTP
(protobuf) to a collector on 127.0.0.1, which decodes them with ``opentelemetry-proto``'s own messages. An SRE's
trial found the exporter failing at start with an ImportError in the project's venv (``xds-protos`` had
overwritten ``opentelemetry-proto``'s files; gateway/observability/otlp.py) and no test of it."""

from __future__ import annotations

import http.server
import threading

import openai
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gateway.observability.otlp import otlp_unavailable
from tests.gateway.support import FaultInjectorUpstream, GatewayProcess, free_port, upstream_config

ROUTES = "  main:\n    targets: [{backend: a}]\n"


class _Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP receiver: every POST body by path."""

    def __init__(self, port: int):
        self.bodies: dict[str, list[bytes]] = {}
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                collector.bodies.setdefault(self.path, []).append(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", port), Handler)


def test_the_gateway_exports_its_spans_over_otlp(tmp_path):
    assert otlp_unavailable() is None
    collector = _Collector(free_port())
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    up = FaultInjectorUpstream("a").start()
    path = tmp_path / "otlp.yaml"
    extra = (f"observability:\n  tracing: {{exporter: otlp, endpoint: 'http://127.0.0.1:{collector.server_port}'}}\n"
             "  logs: {requests: false}\n")
    path.write_text(upstream_config({"a": up}, ROUTES, extra=extra))
    g = GatewayProcess(path, env={"TEST_UPSTREAM_KEY": "k"}).start()
    try:
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    finally:
        g.stop()                      # the shutdown flushes the batch of spans
        up.stop()
        collector.shutdown()
    assert g.proc.returncode == 0, g.log()
    spans = []
    for body in collector.bodies.get("/v1/traces", []):
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
            spans += [(service, s.name) for ss in rs.scope_spans for s in ss.spans]
    assert ("tandem-gateway", "chat m1") in spans, spans
