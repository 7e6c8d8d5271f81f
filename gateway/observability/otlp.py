"""Whether the OTLP exporters load here (``observability.tracing.exporter: otlp``), checked when the config is
read so that a gateway that cannot export says why and exits, rather than failing with a traceback at start.

``xds-protos`` (the ``picker`` and ``test`` extras: Envoy's protos for ``tandem serve --picker-port``) ships its
own, older copy of ``opentelemetry/proto/``, which replaces ``opentelemetry-proto``'s files when installed after
it (an SRE's trial: ``ImportError: cannot import name 'InstrumentationScope'``); reinstalling
``opentelemetry-proto`` puts them back (``make install-test`` does)."""

from __future__ import annotations

import importlib
import importlib.metadata


def otlp_unavailable() -> str | None:
    """None when the OTLP/HTTP span and metric exporters import, else why not and the command that mends it."""
    try:
        for module in ("metric_exporter", "trace_exporter"):
            importlib.import_module(f"opentelemetry.exporter.otlp.proto.http.{module}")
    except ImportError as e:
        try:
            pin = f"=={importlib.metadata.version('opentelemetry-proto')}"
        except importlib.metadata.PackageNotFoundError:
            pin = ""
        return (f"the OTLP exporter does not load ({e}); if xds-protos (the picker extra) overwrote "
                f"opentelemetry-proto's files, run: pip install --force-reinstall --no-deps opentelemetry-proto{pin}")
    return None
