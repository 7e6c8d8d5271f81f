"""Tandem's routing policy as Envoy's endpoint picker (the Gateway API Inference Extension's ``ext_proc``
protocol): ``pick.py`` decides with the gateway's own request path, ``ext_proc.py`` speaks the wire. Served by
``tandem serve --picker-port`` (docs/operators/scale-out.md). Needs the ``picker`` extra (grpcio, xds-protos)."""
