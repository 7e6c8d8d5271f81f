"""The endpoint picker's wire: Envoy's ``envoy.service.ext_proc.v3.ExternalProcessor`` over gRPC (``grpc.aio``, on
the gateway's own event loop), answering as the Gateway API Inference Extension's endpoint-picker protocol says
(docs/proposals/004-endpoint-picker-protocol):

- the picked endpoints as the ``x-gateway-destination-endpoint`` request header and, the same value, as the
  ``envoy.lb`` dynamic metadata's ``x-gateway-destination-endpoint``: ``ip:port`` of the primary, then up to
  ``fallbacks`` more in the order to try them, comma-separated; with ``clear_route_cache`` so Envoy routes on
  them. ``fallbacks`` is 0 by default: Envoy's ``ORIGINAL_DST`` cluster reads the header as one address (a list
  needs a data plane that walks it, e.g. Envoy's ``override_host`` load-balancing policy);
- an ``ImmediateResponse`` for a refusal: 503 when no endpoint is ready, 429 when admission sheds the request,
  the gateway's 400/401/404 for a bad request, each with the gateway's OpenAI error JSON;
- the data plane's subset hint (``envoy.lb.subset_hint``, key ``x-gateway-destination-endpoint-subset``) read
  from the request's ``metadata_context``;
- the gRPC health service with ``liveness``, ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor``
  (not serving while the gateway drains).

Message flow: request headers (picked at once when the request has no body), then the request body, either
BUFFERED (the whole body in one message: Envoy holds the headers until the body's answer, whose header mutation it
applies) or FULL_DUPLEX_STREAMED (the protocol's streaming mode, told by the first message's ``protocol_config``:
the body's pieces are gathered, up to ``MAX_BODY_BYTES``, and at its end, or its trailers, the headers' answer
carries the pick and the body is streamed back). On the response headers the picker adds the
gateway front's ``x-tandem-route``, ``x-tandem-rule`` and ``x-tandem-backend`` (the primary's backend). A pick on a
``prefix_affinity`` route counts as in flight on its replica until the ext_proc stream ends (Envoy ends it with the
request), as the gateway's own calls count between two reads of the replicas' metrics.
"""

from __future__ import annotations

import logging
import time

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import Counter, Histogram

from gateway.errors import error_body
from gateway.picker.pick import Picked, Refused, Resolver, pick

log = logging.getLogger("tandem.picker")

DESTINATION = "x-gateway-destination-endpoint"
NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
# The largest request body gathered (the gateway's front refuses larger ones with 413 too: server.max_body_bytes).
MAX_BODY_BYTES = 32 * 1024 * 1024
# Bytes per body piece streamed back in FULL_DUPLEX_STREAMED mode (Envoy's recommended maximum).
STREAM_CHUNK = 64 * 1024
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def _headers(msg: ep.HttpHeaders) -> dict[str, str]:
    """Envoy's header map (``raw_value`` bytes, or ``value``) as lower-case name -> value."""
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in msg.headers.headers}


def _subset(metadata: base_pb2.Metadata) -> set[str] | None:
    """The data plane's endpoint subset (a list, or a comma-separated string), or None when it sets none."""
    ns = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET not in ns.fields:
        return None
    v = ns.fields[SUBSET]
    items = [x.string_value for x in v.list_value.values] if v.HasField("list_value") else [v.string_value]
    return {e.strip() for item in items for e in item.split(",") if e.strip()}


def _set(headers: dict[str, str]) -> ep.HeaderMutation:
    return ep.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=k, raw_value=v.encode())) for k, v in headers.items()])


def refusal(r: Refused) -> ep.ProcessingResponse:
    """``r`` as Envoy's immediate response (``ImmediateResponse``: status, headers, the OpenAI error JSON)."""
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=r.status), body=r.body,
        headers=_set({"content-type": "application/json", **r.headers}), details=f"tandem_picker_{r.status}"))


def destination(p: Picked, phase: str, fallbacks: int = 0) -> list[ep.ProcessingResponse]:
    """``p`` as the answer to the request's ``phase``: the header and the ``envoy.lb`` metadata, one value (the
    primary and up to ``fallbacks`` more endpoints), and the backend's headers instead of the client's key.
    ``request_headers``: that alone (no body); ``request_body`` (BUFFERED): with the body the gateway would send
    and its length; ``duplex`` (FULL_DUPLEX_STREAMED, the headers held until now): the headers' answer, then the
    body streamed back in ``STREAM_CHUNK`` pieces (Envoy drops the length itself)."""
    value = ",".join(p.endpoints[:1 + fallbacks])
    headers = {**p.upstream_headers, DESTINATION: value}
    if phase == "request_body":
        headers["content-length"] = str(len(p.body))
    mutation = _set(headers)
    if "authorization" not in headers:
        mutation.remove_headers.append("authorization")     # the client's virtual key is the gateway's, not the engine's
    meta = struct_pb2.Struct()
    meta.update({NAMESPACE: {DESTINATION: value}})
    if phase == "request_body":
        common = ep.CommonResponse(header_mutation=mutation, body_mutation=ep.BodyMutation(body=p.body),
                                   clear_route_cache=True)
        return [ep.ProcessingResponse(dynamic_metadata=meta, request_body=ep.BodyResponse(response=common))]
    first = ep.ProcessingResponse(dynamic_metadata=meta, request_headers=ep.HeadersResponse(
        response=ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)))
    if phase == "request_headers":
        return [first]
    pieces = [p.body[k:k + STREAM_CHUNK] for k in range(0, len(p.body), STREAM_CHUNK)] or [b""]
    return [first] + [ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
        body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
            body=piece, end_of_stream=k == len(pieces) - 1))))) for k, piece in enumerate(pieces)]


class _Stream:
    """One request's ext_proc stream: what arrived so far and the pick, once made."""

    def __init__(self, picker: "Picker"):
        self.picker = picker
        self.headers: dict[str, str] = {}
        self.subset: set[str] | None = None
        self.body = bytearray()
        self.duplex = False              # FULL_DUPLEX_STREAMED: the headers' answer waits for the whole body
        self.picked: Picked | Refused | None = None
        self.end = None                  # ends the pick's in-flight count on its replica

    async def answer(self, msg: ep.ProcessingRequest) -> tuple[list[ep.ProcessingResponse], bool]:
        """The answers to ``msg``, and whether the stream is over (a refusal)."""
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            self.headers, self.subset = _headers(msg.request_headers), _subset(msg.metadata_context)
            self.duplex = msg.protocol_config.request_body_mode == FULL_DUPLEX
            if msg.request_headers.end_of_stream:
                return await self.decide("request_headers")
            return ([] if self.duplex else [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]), False
        if kind == "request_body":
            self.body += msg.request_body.body
            if len(self.body) > MAX_BODY_BYTES:
                return [refusal(Refused(413, error_body(413, "Request body too large.", code="body_too_large")))], True
            if msg.request_body.end_of_stream:
                return await self.decide("duplex" if self.duplex else "request_body")
            return ([] if self.duplex else [ep.ProcessingResponse(request_body=ep.BodyResponse())]), False
        if kind == "request_trailers" and self.duplex and self.picked is None:   # the body ended with trailers
            out, over = await self.decide("duplex")
            return out + ([] if over else [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]), over
        if kind == "response_headers":
            tags = {**self.picked.headers, "x-tandem-backend": self.picked.backends[0]} \
                if isinstance(self.picked, Picked) else {}
            return [ep.ProcessingResponse(response_headers=ep.HeadersResponse(
                response=ep.CommonResponse(header_mutation=_set(tags))))], False
        return [ep.ProcessingResponse(**{kind: getattr(ep, _ANSWERS[kind])()})], False   # passed on untouched

    async def decide(self, phase: str) -> tuple[list[ep.ProcessingResponse], bool]:
        self.picked = await self.picker.decide(self.headers.get(":path", ""), bytes(self.body), self.headers,
                                               self.subset)
        if isinstance(self.picked, Refused):
            return [refusal(self.picked)], True
        self.end = self.picker.gw.replicas.hold(self.picked.targets[0])
        return destination(self.picked, phase, self.picker.fallbacks), False


class Picker(ep_grpc.ExternalProcessorServicer):
    """The ext_proc service of one gateway (``gw``: ``gateway.runtime.Gateway``); ``fallbacks``: endpoints sent
    after the primary. Its metrics, in the gateway's registry (``/metrics``):
    ``tandem_picker_decisions_total{route, target, status}`` (``status`` 200: picked, ``target`` the primary;
    else the refusal's status, ``target`` "none") and ``tandem_picker_decision_seconds`` (a pick's time in the
    picker, from the request's last message to its answer)."""

    def __init__(self, gw, fallbacks: int = 0):
        self.gw, self.fallbacks = gw, fallbacks
        self.resolver = Resolver()
        self.decisions = Counter("tandem_picker_decisions", "Endpoint picks (status 200) and refusals.",
                                 ["route", "target", "status"], registry=gw.obs.registry)
        self.seconds = Histogram("tandem_picker_decision_seconds", "Seconds from a request's last message to the "
                                 "picker's answer.", registry=gw.obs.registry,
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))

    async def decide(self, path: str, raw: bytes, headers: dict, subset) -> Picked | Refused:
        t0 = time.perf_counter()
        try:
            out = await pick(self.gw, path, raw, headers, self.resolver, subset)
        except Exception:  # noqa: BLE001 -- a bug must answer 503 for this request, not kill Envoy's stream
            log.exception("endpoint pick failed")
            out = Refused(503, error_body(503, "The endpoint picker failed on this request.", code="picker_error"))
        self.seconds.observe(time.perf_counter() - t0)
        if isinstance(out, Picked):
            self.decisions.labels(out.route, out.targets[0], "200").inc()
        else:
            self.decisions.labels(out.headers.get("x-tandem-route", ""), "none", str(out.status)).inc()
        return out

    async def Process(self, request_iterator, context):   # noqa: N802 -- the gRPC method's name
        stream = _Stream(self)
        try:
            async for msg in request_iterator:
                answers, over = await stream.answer(msg)
                for a in answers:
                    yield a
                if over:
                    return
        finally:
            if stream.end is not None:
                stream.end()


_ANSWERS = {"request_body": "BodyResponse", "response_body": "BodyResponse", "request_trailers": "TrailersResponse",
            "response_trailers": "TrailersResponse"}


class PickerServer:
    """The gRPC server: ext_proc on ``port``, the health service on it and on ``health_port`` (the inference
    extension's endpoint pickers listen on 9002 and 9003); ``fallbacks``: endpoints sent after the primary."""

    def __init__(self, gw, host: str, port: int, health_port: int | None = None, fallbacks: int = 0):
        self.gw, self.host, self.port, self.health_port, self.fallbacks = gw, host, port, health_port, fallbacks
        self.server: grpc.aio.Server | None = None
        self.health = HealthServicer()

    async def start(self) -> None:
        self.server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(Picker(self.gw, self.fallbacks), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for port in (self.port, self.health_port):
            if port is not None:
                self.server.add_insecure_port(f"{self.host}:{port}")
        await self.server.start()
        await self.set_serving(True)
        log.info("endpoint picker (ext_proc) on %s:%s, health on %s", self.host, self.port,
                 self.health_port or self.port)

    async def set_serving(self, serving: bool) -> None:
        """Report ready (``SERVING``) or not (``NOT_SERVING``: draining) to the data plane's health checks."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *HEALTH_SERVICES):
            await self.health.set(name, status if name != "liveness" else health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting streams; those open get ``grace_s`` seconds to finish."""
        if self.server is not None:
            await self.server.stop(grace_s)
