"""What admission reserves of a tenant's budget before a request runs (``gateway/request/admission.py``): its
prompt and every completion it may generate, ``n`` (and completions' ``best_of``) times ``max_tokens``, at its
targets' highest prices; a trial's ``n: 32`` reserved one completion and overspent a budget 4x."""

from __future__ import annotations

from gateway.config.compile import load_config_text
from gateway.request.admission import estimate_nusd, reserved_completion_tokens
from gateway.values import GatewayRequest
from tests.gateway.observability.test_telemetry import CONFIG   # one upstream at 1 / 2 USD per 1M tokens


def _req(endpoint: str, body: dict) -> GatewayRequest:
    return GatewayRequest(endpoint, body, "m1", False, 0, "", {}, body.get("max_tokens"), False, False, None)


def test_the_reservation_counts_every_completion_the_request_may_generate():
    cfg = load_config_text(CONFIG).config
    targets = load_config_text(CONFIG).policy.routes["r1"].targets
    assert [_req("chat/completions", b).sequences for b in ({}, {"n": 32}, {"n": 1, "best_of": 5})] == [1, 32, 1]
    assert [_req("completions", b).sequences for b in ({"n": 2}, {"n": 2, "best_of": 5}, {"best_of": 3})] == [2, 5, 3]
    n32 = _req("chat/completions", {"n": 32, "max_tokens": 60})
    assert reserved_completion_tokens(n32, cfg) == 32 * 60
    assert estimate_nusd(cfg, targets, 10, 32 * 60) == 10 * 1000 + 32 * 60 * 2 * 1000   # 1 / 2 USD per 1M tokens
    # without max_tokens: the configured default completion, times n too
    default = cfg.limits.default_completion_tokens
    assert reserved_completion_tokens(_req("chat/completions", {"n": 4}), cfg) == 4 * default
