"""Fixtures shared by the HTTP tests that run one ``tandem serve`` (a module's own ``gateway`` fixture) over one
fault-injecting upstream: ``upstream`` (backend ``a``) and ``client`` (the official openai SDK on that gateway,
the upstream's calls cleared so a test sees only its own)."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.support import FaultInjectorUpstream


@pytest.fixture(scope="module")
def upstream():
    a = FaultInjectorUpstream("a").start()
    yield a
    a.stop()


@pytest.fixture()
def client(gateway, upstream):
    upstream.calls.clear()
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
