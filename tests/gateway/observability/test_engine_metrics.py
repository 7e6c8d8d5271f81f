"""The gateway with a co-located engine (a tiny random Llama in the gateway's process): its /metrics carries the
engine's vLLM-named metrics next to the gateway's, and spans name the local provider ``tandem``."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.backends.test_local import tiny_model  # noqa: F401 -- the module-scoped fixture
from tests.gateway.observability.test_observability import families, value
from tests.gateway.support import serve_ready

pytestmark = pytest.mark.slow


async def test_colocated_engine_metrics_and_spans(tiny_model):  # noqa: F811
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from gateway.config.compile import load_config_text
    from gateway.runtime import Gateway
    from gateway.observability.tracing import Tracing

    cfg = ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
           "observability:\n  logs: {requests: false}\n"
           "models:\n  - name: tiny\n"
           "backends:\n  local:\n    type: local\n    prices: {input: 0.5, output: 1.5}\n"
           f"    engine: {{model: '{tiny_model}', served_model_name: tiny, dtype: float32, device: cpu,"
           " kv_cache_memory: 32MiB, max_model_len: 512, num_threads: 1}\n"
           "routes:\n  main:\n    targets: [{backend: local}]\npolicy:\n  default_route: main\n")
    gw = Gateway(None, load_config_text(cfg), start_engine=True)
    spans = InMemorySpanExporter()
    gw.obs.tracing = Tracing(span_exporter=spans)
    server, task, url = await serve_ready(gw)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 5,
                                                      "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            fams = families((await c.get("/metrics")).text)
            r = await c.post("/v1/embeddings", json={"model": "tiny", "input": ["a cat sat", "on the mat today"]})
            assert r.status_code == 200, r.text
            embedded = r.json()["usage"]["prompt_tokens"]
            after = families((await c.get("/metrics")).text)
    finally:
        server.should_exit = True
        await task
    assert value(fams, "vllm:prompt_tokens_total", model_name="tiny") == usage["prompt_tokens"]
    assert value(fams, "vllm:generation_tokens_total", model_name="tiny") == usage["completion_tokens"] == 5
    assert value(fams, "vllm:request_success_total", model_name="tiny", finished_reason="length") == 1
    # every reason of vLLM's has its series from the start, at 0 until used (a scale-out trial's "No data")
    assert [value(fams, "vllm:request_success_total", model_name="tiny", finished_reason=r)
            for r in ("stop", "abort", "error", "repetition")] == [0, 0, 0, 0]
    assert value(fams, "vllm:e2e_request_latency_seconds_count", model_name="tiny") == 1
    assert value(fams, "vllm:num_requests_running", model_name="tiny") == 0
    assert "vllm:kv_cache_usage_perc" in fams and "vllm:cache_config_info" in fams
    # Prometheus keeps colons for recording rules: only vLLM's own names have them (an observability trial found
    # tandem:structured_output_invalid_total, now tandem_structured_output_invalid_total)
    assert "tandem_structured_output_invalid_total" in fams
    assert [n for n in fams if ":" in n and not n.startswith("vllm:")] == []
    # embeddings count as vLLM counts pooling requests (a trial found them missing): per input, its tokens, one
    # success ("stop"), one latency
    assert value(after, "vllm:prompt_tokens_total", model_name="tiny") == usage["prompt_tokens"] + embedded
    assert value(after, "vllm:request_success_total", model_name="tiny", finished_reason="stop") == 2
    assert value(after, "vllm:e2e_request_latency_seconds_count", model_name="tiny") == 3
    assert value(after, "vllm:request_prompt_tokens_sum", model_name="tiny") == usage["prompt_tokens"] + embedded
    assert value(after, "vllm:generation_tokens_total", model_name="tiny") == 5
    assert value(fams, "tandem_requests_total", model="tiny", route="main", backend="local", status=200,
                 attempt="initial") == 1
    assert value(fams, "tandem_input_tokens_total", backend="local", tenant="anonymous") == usage["prompt_tokens"]
    assert value(fams, "tandem_cost_usd_total", backend="local", tenant="anonymous") == pytest.approx(
        (usage["prompt_tokens"] * 0.5 + 5 * 1.5) / 1e6, abs=1e-12)
    client = [s for s in spans.get_finished_spans() if s.kind == SpanKind.CLIENT]
    assert [s.attributes["gen_ai.provider.name"] for s in client] == ["tandem", "tandem"]
    assert [s.name for s in client] == ["text_completion tiny", "embeddings tiny"]
    assert [s.attributes.get("gen_ai.request.max_tokens") for s in client] == [5, None]   # embeddings: none
