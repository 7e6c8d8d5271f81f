"""Property: no request value can fail the backend. Random JSON values in every documented field of a chat
request, sent through the gateway to its local engine (a tiny random model), get 200 or a 4xx, never a 5xx, and
the local target's breaker (open after one failure here) is still closed afterwards."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.protocol.param_ranges import INT64_MAX, INT64_MIN, UINT64_MAX
from engine.serving.protocol import ChatCompletionRequest
from gateway.request.validate import LOCAL_UNSUPPORTED
from tests.gateway.support import GatewayProcess
from tests.tiny_models import save_byte_level_llama

CONFIG = """
models:
  - name: tiny
backends:
  local:
    type: local
    engine: {{model: '{model}', served_model_name: tiny, dtype: float32, device: cpu, kv_cache_memory: 32MiB,
             max_model_len: 256, max_num_seqs: 16, num_threads: 1}}
routes:
  main:
    targets: [{{backend: local}}]
policy:
  default_route: main
resilience:
  retry: {{max_attempts: 2, backoff_initial_s: 0.01, backoff_max_s: 0.02}}
  breaker: {{consecutive_failures: 1, open_s: 600}}
  health: {{interval_s: 0}}
"""
# Every field of the engine's chat schema and every field the gateway knows by name.
FIELDS = sorted({f.name for f in msgspec.structs.fields(ChatCompletionRequest)} | set(LOCAL_UNSUPPORTED)
                | {"metadata", "priority", "stream_options"})
BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

EDGES = st.sampled_from([2 ** 70, -(2 ** 70), UINT64_MAX, UINT64_MAX + 1, INT64_MAX, INT64_MIN, INT64_MIN - 1,
                         -1, 0, 1, 129, 1e308, -1e308, 0.5, "", "x" * 300, [], {}])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20) | EDGES,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=3),
                    max_leaves=6)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    model = save_byte_level_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=512)
    path = tmp_path_factory.mktemp("fields") / "config.yaml"
    path.write_text(CONFIG.format(model=model))
    g = GatewayProcess(path).start(timeout=180)
    yield g
    g.stop()


@settings(max_examples=60, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@example(fields={"seed": 2 ** 70})                     # the values that once failed the engine
@example(fields={"max_tokens": 2 ** 64, "stream": True})
@example(fields={"n": 10 ** 6})
@given(fields=st.dictionaries(st.sampled_from(FIELDS), JSON, min_size=1, max_size=3))
def test_random_values_in_every_field_never_fail_the_backend(gateway, fields):
    body = {**BASE, **fields}
    r = httpx.post(gateway.url + "/v1/chat/completions", content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert '"error"' not in r.text, (body, r.text)
    targets = httpx.get(gateway.url + "/health/ready", timeout=10).json()["targets"]
    assert all(t["breaker"] == "closed" for t in targets.values()), (body, targets)
