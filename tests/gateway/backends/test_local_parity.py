"""The local backend and ``tandem engine serve`` answer alike: the same battery of SmolLM2 requests through the
official ``openai`` SDK (``local_battery.py``: streamed and whole, logprobs, tool calls, structured outputs,
usage, finish and stop reasons, several choices and prompts) gives the same answers from the gateway, whose
local backend reads the engine's typed chunks in process, and from the engine's own server, which writes them
as JSON and SSE (``engine/serving/chunks.py``). Ids and creation times aside, nothing may differ."""

from __future__ import annotations

import pytest

from tests.gateway.backends.local_battery import first_difference, run_battery
from tests.gateway.support import GatewayProcess, engine_serve

pytestmark = pytest.mark.slow

CONFIG = """
models: [{{name: smollm2}}]
backends:
  local:
    type: local
    structured_outputs: [response_format, tools]
    engine: {{served_model_name: smollm2, max_model_len: 1024, max_num_seqs: 8, kv_cache_memory: 256MiB}}
routes:
  only: {{targets: [{{backend: local}}]}}
policy: {{default_route: only}}
"""


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    with engine_serve(["--served-model-name", "smollm2", "--max-model-len", "1024", "--max-num-seqs", "8",
                       "--kv-cache-memory", "256MiB"], tmp_path_factory.mktemp("engine"), timeout_s=300) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    path = tmp_path_factory.mktemp("gw") / "config.yaml"
    path.write_text(CONFIG.format())
    g = GatewayProcess(path).start(timeout=300)
    yield g
    g.stop()


def test_the_local_backend_answers_as_the_engines_own_server(gateway, engine_server):
    through_gateway = run_battery(gateway.url + "/v1", "smollm2")
    direct = run_battery(engine_server + "/v1", "smollm2")
    assert through_gateway.keys() == direct.keys()
    differ = {name: first_difference(through_gateway[name], direct[name]) for name in direct
              if through_gateway[name] != direct[name]}
    assert differ == {}, f"gateway != engine in {len(differ)} answers: " + "; ".join(
        f"{name}{where}" for name, where in differ.items())
    # the battery exercised what it names
    calls = direct["chat/tool_required"]["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    assert direct["chat/greedy_logprobs"]["choices"][0]["logprobs"]["content"]
    assert direct["chat/greedy_logprobs/stream"][-1]["usage"]["completion_tokens"] > 0
    assert len(direct["completions/two_prompts"]["choices"]) == 2
