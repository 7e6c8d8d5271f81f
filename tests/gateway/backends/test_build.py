"""``build_backends`` on a reload: the local engine is kept (never reloaded in place), and the reload warns that
a restart is needed only while its engine settings differ from those it was started with."""

from __future__ import annotations

from gateway.backends.build import build_backends
from gateway.config.backend_schema import LocalBackendConfig


def _local(**fields) -> LocalBackendConfig:
    return LocalBackendConfig.model_validate({"type": "local", **fields})


def test_only_engine_settings_need_a_restart():
    """An observability trial changed only the local backend's prices: every later reload warned "engine settings
    changed; restart to apply them" (the whole backend config was compared), though the prices were applied."""
    first, _ = build_backends({"local": _local()}, {}, [])
    warnings: list[str] = []
    again, local = build_backends({"local": _local(prices={"input": 1, "output": 2}, rpm=10)}, first, warnings)
    assert warnings == [] and local is first["local"] and again["local"] is first["local"]
    build_backends({"local": _local(prices={"input": 3, "output": 4})}, again, warnings)
    assert warnings == []
    build_backends({"local": _local(engine={"max_model_len": 256})}, again, warnings)
    assert warnings == ["backends.local: engine settings changed; restart to apply them"]
