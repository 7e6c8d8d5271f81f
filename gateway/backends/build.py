"""The backends of one config generation, from the config's ``backends:`` section: one object per backend, of
the class its ``type`` names, the previous generation's object kept where nothing it was built from changed
(a reload never reloads the engine, and keeps an upstream's connections when its settings and key are the
same). The one place that maps a backend ``type`` to its class."""

from __future__ import annotations

import os
from collections.abc import Mapping

from gateway.backends.anthropic import AnthropicBackend
from gateway.backends.local import LocalBackend
from gateway.backends.upstream import UpstreamBackend

_UPSTREAMS = {"openai": UpstreamBackend, "anthropic": AnthropicBackend}


def _api_key(cfg) -> str | None:
    return os.environ.get(cfg.api_key_env) if cfg.api_key_env else None


def build_backends(configs: Mapping[str, object], old: Mapping[str, object],
                   warnings: list[str]) -> tuple[dict, LocalBackend | None]:
    """The backends for ``configs`` (name -> backend config) given the previous generation's ``old`` (name ->
    backend), and the local one (None without); what a reload cannot apply or a backend that cannot be used is
    appended to ``warnings``."""
    backends: dict = {}
    local = None
    for name, cfg in configs.items():
        prev = old.get(name)
        if cfg.type == "local":
            if isinstance(prev, LocalBackend):
                if prev.cfg.engine != cfg.engine:   # its prices, cost and limits are read from each generation
                    warnings.append(f"backends.{name}: engine settings changed; restart to apply them")
                backends[name] = prev       # the engine is never reloaded in place
            else:
                backends[name] = LocalBackend(name, cfg)
            local = backends[name]
            continue
        cls = _UPSTREAMS[cfg.type]
        if type(prev) is cls and (prev.cfg, _api_key(prev.cfg)) == (cfg, _api_key(cfg)):
            backends[name] = prev
        else:
            backends[name] = cls(name, cfg)
            if not backends[name].available:
                warnings.append(f"backend {name} unavailable: {backends[name].unavailable_reason}")
    return backends, local
