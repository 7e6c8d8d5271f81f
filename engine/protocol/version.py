"""The ``tandem`` package's version as both servers' ``GET /version`` answer it (vLLM's route: ``{"version"}``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def tandem_version() -> str:
    """The installed ``tandem`` distribution's version; "unknown" in a source tree that was never installed."""
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown"
