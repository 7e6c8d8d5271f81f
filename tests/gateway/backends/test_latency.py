"""Upstreams' rolling TTFT and error estimates, and an ``slo`` route end to end: a real gateway process, two
fake aggregators on 127.0.0.1, the official ``openai`` client. The cheaper aggregator serves until the gateway
has seen it answer slower than the SLO; then the dearer, faster one does, and ``x-tandem-slo`` says why."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import openai
import pytest

from gateway.backends.latency import (DEFAULT_MARGIN, LOCAL_PROBE_AFTER_S, RATIO_WINDOW_S, WINDOW,
                                      UpstreamLatency)
from policies import TTFTEstimate
from gateway.resilience.outcomes import UpstreamResponse
from gateway.translate.chat_events import decode_stream
from tests.gateway.support import FaultInjectorUpstream, GatewayProcess, upstream_config


def test_rolling_estimate_is_the_p90_of_recent_answers_and_counts_errors():
    lat = UpstreamLatency()
    assert lat.estimate("a").seconds is None
    for i in range(10):
        lat.observe("a", 0.1 * (i + 1))
    assert lat.estimate("a").seconds == pytest.approx(1.0)
    assert lat.estimate("a").error_rate == 0
    for _ in range(10):
        lat.observe("a", None)
    assert lat.estimate("a").error_rate == pytest.approx(0.5)
    for _ in range(WINDOW):
        lat.observe("a", 0.2)
    e = lat.estimate("a")
    assert e.seconds == pytest.approx(0.2) and e.error_rate == 0   # the window forgot the old calls
    # and so does time: a policy trial's cheap upstream, slow once, was kept away for good (nothing sent it a call)
    t0 = 1000.0
    lat.observe("slow", 1.0, now=t0)
    lat.observe_tpot("slow", 0.5, now=t0)
    assert (lat.estimate("slow", now=t0 + 1).seconds, lat.estimate("slow", now=t0 + 1).tpot) == (1.0, 0.5)
    gone = lat.estimate("slow", now=t0 + RATIO_WINDOW_S + 1)
    assert (gone.seconds, gone.tpot, gone.error_rate) == (None, None, 0) and "no calls in the last" in gone.basis


def test_local_predictions_are_corrected_by_what_the_engine_delivered():
    lat = UpstreamLatency()
    assert lat.correction() == (1.0, DEFAULT_MARGIN, "")
    for i in range(20):
        lat._predicted[f"r{i}"] = {"": 2.0}
        lat.observe_local(f"r{i}", 2.0 * (1.0 + 0.05 * i))   # the engine delivers 1.0x .. 1.95x its prediction
    factor, margin, why = lat.correction()
    assert factor == pytest.approx(1.5) and "median of measured/predicted, last 20 answers" in why
    assert margin == pytest.approx(1.9 / 1.5)                 # the p90 ratio over the median
    lat.observe_local("never-predicted", 50.0)
    lat._predicted["tiny"] = {"": 0.01}
    lat.observe_local("tiny", 0.05)                           # both floored: 1, not 5x
    lat._predicted["short"] = {"": 0.2}
    lat.observe_local("short", 0.1)                           # both floored: 1, not 0.1 / 0.25
    assert [r for _, r in lat._ratios[""]][-2:] == [1.0, 1.0]
    later = lat._ratios[""][-1][0] + RATIO_WINDOW_S + 1           # no answers for a minute: the factor expires
    assert lat.correction(now=later) == (1.0, DEFAULT_MARGIN, "")


def test_an_idle_engine_predicted_late_gets_a_probe_then_its_answer_counts():
    """A fit gone wrong (44.8 s predicted on an idle engine) would keep an SLO route's every request away from
    the engine, and with no steps the fit never refreshes: an idle engine with no answer for
    ``LOCAL_PROBE_AFTER_S`` gets one request (no estimate), a busy one never, and an answer restarts the wait."""
    lat = UpstreamLatency()
    lat._local = "local"
    late = TTFTEstimate(44.8, "stale costs", high=53.8)
    idle = SimpleNamespace(get_stats=lambda: SimpleNamespace(num_running=0, num_waiting=0))
    busy = SimpleNamespace(get_stats=lambda: SimpleNamespace(num_running=1, num_waiting=0))
    t0 = lat._local_probed_at
    assert lat._probe(idle, late, now=t0 + 1) is late                     # too soon
    later = t0 + LOCAL_PROBE_AFTER_S + 1
    assert lat._probe(busy, late, now=later) is late                      # busy: its steps refit its costs
    probe = lat._probe(idle, late, now=later)
    assert probe.seconds is None and probe.checked is None and "probe" in probe.basis
    assert lat._probe(idle, late, now=later + 1) is late                  # one probe, then wait again
    lat._predicted["r1"] = {"local": 44.8}
    lat.observe_predicted("r1", "local", 0.3)                             # the probe's answer
    assert lat._probe(idle, late, now=lat._local_probed_at + LOCAL_PROBE_AFTER_S - 1) is late


def test_a_stream_is_timed_at_its_first_content_not_its_role_event():
    """Engines and providers send the role event at once: the TTFT is the first content's."""
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    content = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'

    async def chunks():
        yield role
        await asyncio.sleep(0.2)
        yield content[:12]       # an event split across reads
        yield content[12:] + b"data: [DONE]\n\n"

    async def attempt(c):
        return UpstreamResponse(200, events=decode_stream(chunks()))

    async def main():
        lat = UpstreamLatency()
        resp = await lat.track("r1")(attempt)(SimpleNamespace(target=SimpleNamespace(backend="agg")))
        got = [ev for batch in [b async for b in resp.events] for ev in batch]
        assert [ev.kind for ev in got] == ["meta", "content", "done"]
        return lat.estimate("agg").seconds

    assert asyncio.run(main()) >= 0.2


def test_a_stream_gives_its_upstreams_tpot():
    """Seconds per content event after the first, of each streamed answer: the upstream's TPOT figure (p90)."""
    def event(text: str) -> bytes:
        return b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text.encode()

    async def chunks():
        yield event("a")
        for t in "bcde":
            await asyncio.sleep(0.05)
            yield event(t)
        yield b"data: [DONE]\n\n"

    async def attempt(c):
        return UpstreamResponse(200, events=decode_stream(chunks()))

    async def main():
        lat = UpstreamLatency()
        resp = await lat.track("r1")(attempt)(SimpleNamespace(target=SimpleNamespace(backend="agg")))
        async for _ in resp.events:
            pass
        return lat.estimate("agg").tpot

    assert asyncio.run(main()) >= 0.05


ROUTES = """  main:
    targets: [{backend: cheap}, {backend: dear}]
    slo: {ttft_ms: 300}
"""


@pytest.fixture()
def gateway(tmp_path):
    cheap, dear = FaultInjectorUpstream("cheap").start(), FaultInjectorUpstream("dear").start()
    path = tmp_path / "gw.yaml"
    path.write_text(upstream_config({"cheap": cheap, "dear": dear}, ROUTES).replace("watch: true", "watch: false"))
    gw = GatewayProcess(path, env={"TEST_UPSTREAM_KEY": "k"}).start()
    yield gw, cheap, dear
    gw.stop()
    cheap.stop()
    dear.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_slo_route_leaves_a_cheap_upstream_once_it_is_seen_slow(gateway, stream):
    gw, cheap, dear = gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)

    def ask() -> tuple[str, str]:
        raw = client.chat.completions.with_raw_response.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=10, stream=stream)
        if stream:
            for _ in raw.parse():
                pass
        return raw.headers["x-tandem-backend"], raw.headers["x-tandem-slo"]

    backend, why = ask()
    assert backend == "cheap" and "cheap no estimate yet" in why
    cheap.set_mode(delay=0.6)
    assert ask()[0] == "cheap"           # seen slow now
    backend, why = ask()
    assert backend == "dear"
    assert why.startswith("SLO ttft 300 ms: cheapest predicted to meet it: dear")
    assert "cheap predicted 0.6" in why and "> SLO 0.3 s" in why
