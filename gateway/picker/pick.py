"""The endpoint picker's decision: one request (its path, headers and body, as Envoy hands them over ``ext_proc``)
-> the engine endpoints to send it to, in order, or the refusal Envoy answers in the gateway's place.

The same steps as the gateway's own front (``gateway/request/pipeline.py``), not a copy of them: the request value
(``build_request``: auth, validation, the public model), the policy's decision on the live signals
(``decide_route``: rules, SLO ranking with the replicas' TTFT predictions, prefix affinity with their loads,
unusable backends left out) and admission (``admit``: the RPM/TPM limits, 429). What the picker adds is only what
turns the decision's targets into the protocol's endpoints (docs/proposals/004-endpoint-picker-protocol of the
Gateway API Inference Extension):

- an endpoint is an OpenAI-compatible backend's host and port (``endpoint()``), its host resolved, as
  Envoy's ``ORIGINAL_DST`` cluster needs ``ip:port`` (a Kubernetes pod name resolves to the pod's IP);
- an endpoint is ready unless its replica's metrics stopped answering (``prefix_affinity`` routes, read every
  ``affinity.metrics_interval_s``), its last active probe failed or its breaker is open: the protocol's "no ready
  endpoint" is then a 503, where the gateway's front would still try the dead one last;
- the data plane's subset hint (``envoy.lb.subset_hint``) keeps only the endpoints it lists; none left: 503;
- the body and headers Envoy sends are the ones the gateway would send the primary (``passthrough_body``: the
  target's upstream model name, the gateway's own fields dropped; the backend's headers, the client's virtual key
  removed), so a fallback endpoint is listed only when it would be sent the same.

The co-located engine (a ``local`` backend) has no address and is never an endpoint. Budgets are the gateway
front's alone: the picker never sees an answer's usage, so a config with budgets is refused at start and, loaded
by a reload, answers 503 (``check_config``).
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.backends.dispatch import passthrough_body
from gateway.errors import ClientError, error_body
from gateway.request.admission import admit
from gateway.request.pipeline import build_request, decide_route

# The request paths the picker routes (Envoy's ``:path``, query left out) -> the gateway's endpoint name.
PATHS = {"/v1/chat/completions": "chat/completions", "/v1/completions": "completions",
         "/v1/embeddings": "embeddings"}
# Seconds a resolved engine address is kept: a restarted pod comes back on a new IP under the same name.
RESOLVE_TTL_S = 5.0


@dataclass(frozen=True)
class Picked:
    """Where a request goes: ``endpoints`` (``ip:port``, the first the primary, then the fallbacks in the order to
    try them), each one's target id (``targets``) and backend name (``backends``), and the decision's ``route`` and
    ``rule``."""

    endpoints: list[str]
    targets: list[str]
    backends: list[str]
    route: str
    rule: str
    body: bytes                    # what the endpoints are sent (JSON)
    upstream_headers: dict[str, str]   # the headers they are sent (the backend's)
    headers: dict[str, str] = field(default_factory=dict)   # the gateway front's x-tandem-* and x-ratelimit-*


@dataclass(frozen=True)
class Refused:
    """A request Envoy answers in the gateway's place: ``status`` (400/401/404/429/503...), the OpenAI error JSON
    ``body`` and ``headers`` (``retry-after``...)."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, e: ClientError) -> "Refused":
        return cls(e.status, error_body(e.status, e.message, e.param, e.code), dict(e.headers))


def check_config(compiled) -> str:
    """Why the picker cannot serve this config ("" when it can)."""
    if compiled.config.budgets.tenants:
        return ("budgets are enforced by the gateway's own front only (the picker never sees an answer's usage); "
                "remove budgets.tenants or serve those tenants through the front")
    return ""


class Resolver:
    """Host -> address, cached ``RESOLVE_TTL_S`` seconds (``loop.getaddrinfo``; an IP literal as it is)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[float, str]] = {}

    async def address(self, host: str, port: int) -> str | None:
        """``ip:port`` (``[ip6]:port``) of ``host``, or None when it does not resolve."""
        now = time.monotonic()
        hit = self._cache.get(host)
        if hit is None or now - hit[0] > RESOLVE_TTL_S:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (socket.gaierror, OSError):
                return None
            hit = (now, infos[0][4][0])
            self._cache[host] = hit
        ip = hit[1]
        return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def not_ready(gw, target) -> str:
    """Why ``target`` (a ``policies.Target``) is no endpoint now ("" when it is one)."""
    backend = gw.snapshot.backends.get(target.backend)
    if backend is None or backend.endpoint() is None:
        return "no address (the co-located engine, or not OpenAI's API)"
    load = gw.replicas.loads().get(target.id) if gw.replicas.tracked else None
    if load is not None and not load.alive:
        return "metrics unreachable (dead?)"
    probe = await gw.resilience.health.last_probe(target.backend)
    if probe is not None and not probe["ok"]:
        return "last probe failed"
    if (await gw.resilience.breakers.get(target.id)).state == "open":
        return "breaker open"
    return ""


async def pick(gw, path: str, raw: bytes, headers: Mapping[str, str], resolver: Resolver,
               subset: set[str] | None = None) -> Picked | Refused:
    """The endpoints for one request, or its refusal.

    Args:
        gw: the ``gateway.runtime.Gateway`` (its current config generation, replica loads, breakers, limits).
        path: the request's ``:path`` (a query string is ignored).
        raw: the request body, bytes.
        headers: lower-case header names -> values.
        resolver: the picker's address cache.
        subset: the data plane's ``x-gateway-destination-endpoint-subset`` (``ip:port`` or ``ip``), or None.
    """
    endpoint = PATHS.get(path.split("?", 1)[0])
    if endpoint is None:
        return Refused(404, error_body(404, f"The endpoint picker routes {', '.join(PATHS)}; not {path}.",
                                       code="unknown_url"))
    if gw.draining or gw.snapshot is None:
        return Refused(503, error_body(503, "The gateway is draining.", code="draining"))
    if why := check_config(gw.snapshot.compiled):     # a reload may have added what the picker cannot serve
        return Refused(503, error_body(503, f"The endpoint picker cannot serve this config: {why}.",
                                       code="picker_unsupported_config"))
    request_id = headers.get("x-request-id") or uuid.uuid4().hex
    try:
        req = build_request(gw.snapshot, endpoint, raw, headers, request_id)
        decision, affinity = await decide_route(gw, req)
        adm = await admit(req, decision.attempts, gw.resilience, gw.usage, gw.snapshot.compiled.config)
    except ClientError as e:
        return Refused.of(e)
    tags = {"x-tandem-route": decision.route, "x-tandem-rule": decision.rule, **adm.headers}
    if decision.pick.reason.startswith("SLO"):   # the numbers the SLO decision was made on, as the front says
        tags["x-tandem-slo"] = decision.pick.reason
    endpoints, targets, backends, sent, why = [], [], [], None, []
    for t in decision.attempts:
        reason = await not_ready(gw, t)
        backend = gw.snapshot.backends.get(t.backend)
        hp = backend.endpoint() if not reason else None
        address = await resolver.address(*hp) if hp is not None else None
        if hp is not None and address is None:
            reason = f"{hp[0]} does not resolve"
        elif subset is not None and address is not None and not ({address, address.rsplit(":", 1)[0]} & subset):
            reason = "not in the data plane's subset"
        if reason:
            why.append(f"{t.id}: {reason}")
            continue
        this = (passthrough_body(backend, t, req, req.body), backend.request_headers())
        if address not in endpoints and (sent is None or this == sent):
            sent = sent or this
            endpoints.append(address)
            targets.append(t.id)
            backends.append(t.backend)
    if not endpoints:
        await gw.resilience.settle(adm.rate, {"total_tokens": 0})   # nothing was sent: give the tokens back
        said = "; ".join(why) or "the route has no available target"
        return Refused(503, error_body(503, f"No ready endpoint for route '{decision.route}' (rule "
                                            f"'{decision.rule}'): {said}.", code="no_backend_available"),
                       {**tags, "x-tandem-backend": "none"})
    if affinity:
        gw.replicas.note(decision.route, decision.pick)
    return Picked(endpoints, targets, backends, decision.route, decision.rule, sent[0], sent[1], tags)
