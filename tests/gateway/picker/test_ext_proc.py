"""The endpoint picker's wire, from a gRPC client playing Envoy (the generated ``ExternalProcessor`` stub, no
Envoy): ``tandem serve --picker-port`` on a ``cheapest`` route over two upstreams (nothing needs to answer: the
picker never calls an engine). Checked against the endpoint-picker protocol: the destination header and the
``envoy.lb`` metadata carry one value (the primary, then ``--picker-fallbacks`` more), the body Envoy sends is the
gateway's (the upstream model name) with its length and the backend's key, the data plane's subset hint restricts
the pick (none left: 503), a bad request is refused with the gateway's status and JSON, the response headers get
the front's ``x-tandem-*``, and the health service answers the extension's service names."""

from __future__ import annotations

import json

import httpx
import pytest

grpc = pytest.importorskip("grpc", reason="the picker extra (grpcio, xds-protos) is not installed")
ep = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="xds-protos is not installed")

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402
from google.protobuf import json_format, struct_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from tests.gateway.support import GatewayProcess, free_port  # noqa: E402

PORTS = {"cheap": free_port(), "dear": free_port()}


class Ports(dict):
    def __init__(self):
        super().__init__()
        self.fronts: dict[int, int] = {}


@pytest.fixture(scope="module")
def pickers(tmp_path_factory):
    """{fallbacks: picker port}: two gateways on one config, with 0 and 1 fallbacks (``.fronts``: their HTTP
    ports, by the same keys)."""
    backends = "".join(f"  {n}:\n    type: openai\n    base_url: http://127.0.0.1:{p}/v1\n    api_key_env: UP_KEY\n"
                       f"    models: {{m1: up-model}}\n    prices: {{input: {i + 1}, output: {i + 1}}}\n"
                       for i, (n, p) in enumerate(PORTS.items()))
    path = tmp_path_factory.mktemp("ext-proc") / "config.yaml"
    path.write_text("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
                    f"models:\n  - name: m1\nbackends:\n{backends}"
                    "routes:\n  main:\n    select: cheapest\n    targets: [{backend: cheap}, {backend: dear}]\n"
                    "policy:\n  default_route: main\n  rules: []\n")
    out, procs = Ports(), []
    try:
        for fallbacks in (0, 1):
            out[fallbacks] = free_port()
            procs.append(GatewayProcess(path, env={"UP_KEY": "upstream-key"}, extra_args=[
                "--picker-port", str(out[fallbacks]), "--picker-fallbacks", str(fallbacks)]).start())
            out.fronts[fallbacks] = procs[-1].port
        yield out
    finally:
        for p in procs:
            p.stop()


def headers(**h) -> ep.HttpHeaders:
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode()) for k, v in h.items()]),
        end_of_stream=False)


def process(port: int, body: dict | bytes, subset=None, path: str = "/v1/chat/completions") -> list:
    """One request's messages (headers, body, response headers) through the picker; its answers."""
    meta = base_pb2.Metadata()
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        meta.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    msgs = [ep.ProcessingRequest(request_headers=headers(**{":path": path, ":method": "POST",
                                                            "authorization": "Bearer client-key"}),
                                 metadata_context=meta),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True)),
            ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap()))]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return list(ep_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=30))


def set_headers(common) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "priority": "high"}


def test_the_pick_is_the_header_and_the_metadata_with_the_gateways_body(pickers):
    first, body, response = process(pickers[0], CHAT)
    assert first.WhichOneof("response") == "request_headers"
    common = body.request_body.response
    sent = set_headers(common)
    cheap = f"127.0.0.1:{PORTS['cheap']}"
    assert sent["x-gateway-destination-endpoint"] == cheap and common.clear_route_cache
    meta = json_format.MessageToDict(body.dynamic_metadata)
    assert meta == {"envoy.lb": {"x-gateway-destination-endpoint": cheap}}
    out = json.loads(common.body_mutation.body)
    assert out["model"] == "up-model" and "priority" not in out and out["messages"] == CHAT["messages"]
    assert sent["content-length"] == str(len(common.body_mutation.body))
    assert sent["authorization"] == "Bearer upstream-key"       # the backend's key, not the client's
    tags = set_headers(response.response_headers.response)
    assert tags["x-tandem-backend"] == "cheap" and tags["x-tandem-route"] == "main"


def test_fallbacks_follow_the_primary_in_the_routes_order(pickers):
    body = process(pickers[1], CHAT)[1]
    value = f"127.0.0.1:{PORTS['cheap']},127.0.0.1:{PORTS['dear']}"
    assert set_headers(body.request_body.response)["x-gateway-destination-endpoint"] == value
    assert json_format.MessageToDict(body.dynamic_metadata)["envoy.lb"]["x-gateway-destination-endpoint"] == value


def test_the_subset_hint_restricts_the_pick_and_an_empty_one_is_503(pickers):
    body = process(pickers[1], CHAT, subset=[f"127.0.0.1:{PORTS['dear']}"])[1]
    assert set_headers(body.request_body.response)["x-gateway-destination-endpoint"] == f"127.0.0.1:{PORTS['dear']}"
    body = process(pickers[0], CHAT, subset=f"10.0.0.1:80, 127.0.0.1:{PORTS['dear']}")[1]   # a string list too
    assert set_headers(body.request_body.response)["x-gateway-destination-endpoint"] == f"127.0.0.1:{PORTS['dear']}"
    refused = process(pickers[0], CHAT, subset=["10.0.0.1:80"])[1].immediate_response
    assert refused.status.code == 503 and json.loads(refused.body)["error"]["code"] == "no_backend_available"


def test_a_bad_request_is_refused_as_the_front_refuses_it(pickers):
    refused = process(pickers[0], {**CHAT, "model": "nope"})[1].immediate_response
    assert refused.status.code == 404 and json.loads(refused.body)["error"]["code"] == "model_not_found"
    refused = process(pickers[0], b"{not json")[1].immediate_response
    assert refused.status.code == 400
    refused = process(pickers[0], CHAT, path="/v1/models")[1].immediate_response
    assert refused.status.code == 404 and json.loads(refused.body)["error"]["code"] == "unknown_url"
    content_type = {h.header.key: h.header.raw_value for h in refused.headers.set_headers}["content-type"]
    assert content_type == b"application/json"


def test_the_health_service_answers_the_extensions_names(pickers):
    with grpc.insecure_channel(f"127.0.0.1:{pickers[0]}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_the_streaming_mode_holds_the_headers_and_streams_the_body_back(pickers):
    """FULL_DUPLEX_STREAMED (told by ``protocol_config``): nothing answers the headers or the first body piece;
    at the body's end the headers' answer carries the pick, then the gateway's body comes back streamed."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    raw = json.dumps(CHAT).encode()
    mode = ep.ProtocolConfiguration(request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED)
    msgs = [ep.ProcessingRequest(request_headers=headers(**{":path": "/v1/chat/completions", ":method": "POST"}),
                                 protocol_config=mode),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=raw[:10])),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=raw[10:], end_of_stream=True))]
    with grpc.insecure_channel(f"127.0.0.1:{pickers[0]}") as ch:
        answers = list(ep_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=30))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    sent = set_headers(answers[0].request_headers.response)
    assert sent["x-gateway-destination-endpoint"] == f"127.0.0.1:{PORTS['cheap']}" and "content-length" not in sent
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.end_of_stream and json.loads(streamed.body)["model"] == "up-model"


def test_picks_and_refusals_are_counted_in_the_gateways_metrics(pickers):
    def count(port: int, **labels) -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tandem_picker_decisions_total{") and
                   ",".join(sorted(line[line.index("{") + 1:line.index("}")].split(","))) == want)

    front = pickers.fronts[0]
    picked = count(front, route="main", target="cheap", status="200")
    refused = count(front, route="main", target="none", status="503")
    process(pickers[0], CHAT)
    process(pickers[0], CHAT, subset=["10.0.0.1:80"])
    assert count(front, route="main", target="cheap", status="200") == picked + 1
    assert count(front, route="main", target="none", status="503") == refused + 1
