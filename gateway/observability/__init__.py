"""Observability: Prometheus metrics, OpenTelemetry traces, the JSON request log."""
