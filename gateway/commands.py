"""The gateway's ``tandem`` sub-commands: ``serve``, ``route explain``,
``ctl`` (reload, rollback, weights, drain, config via the admin API), and
``usage`` / ``cost estimate`` (from ``gateway/billing/commands.py``)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(subparsers) -> None:
    """Add ``serve``, ``route`` and ``ctl`` to the ``tandem`` parser."""
    p = subparsers.add_parser("serve", help="run the gateway (with the in-process engine)")
    p.add_argument("--config", required=True, help="YAML config file (see config.example.yaml)")
    p.add_argument("--host", default=None, help="bind address (default: server.host)")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: server.port)")
    p.add_argument("--insecure", action="store_true", help="allow a public bind without virtual keys")
    p.add_argument("--no-engine", action="store_true", help="do not start the local engine (upstreams only)")
    p.set_defaults(func=_serve)

    p = subparsers.add_parser("route", help="routing policy tools")
    sub = p.add_subparsers(dest="route_command", required=True)
    e = sub.add_parser("explain", help="print the routing decision for a request, sending nothing")
    e.add_argument("--config", required=True)
    e.add_argument("--request", required=True, help="JSON file with the request body (chat or completion)")
    e.add_argument("--header", action="append", default=[], metavar="NAME=VALUE", help="request header (repeat)")
    e.add_argument("--tenant", default="", help="tenant of the virtual key")
    e.add_argument("--waiting", type=int, default=0, help="local engine: waiting requests")
    e.add_argument("--running", type=int, default=0, help="local engine: running requests")
    e.add_argument("--kv-usage", type=float, default=0.0, help="local engine: KV-cache usage, percent")
    e.add_argument("--request-id", default="explain", help="request id (canary key of last resort)")
    e.add_argument("--replica-load", action="append", default=[], metavar="TARGET=N",
                   help="prefix_affinity routes: requests running + waiting on that replica (repeat; default 0; "
                        "'TARGET=dead' for one whose metrics do not answer)")
    e.add_argument("--json", action="store_true", help="print the decision as JSON")
    e.set_defaults(func=_explain)

    p = subparsers.add_parser("ctl", help="control a running gateway through its admin API")
    p.add_argument("--url", default=os.environ.get("TANDEM_URL", "http://127.0.0.1:8000"))
    p.add_argument("--token-env", default="TANDEM_ADMIN_TOKEN", help="env var holding the admin token")
    sub = p.add_subparsers(dest="ctl_command", required=True)
    sub.add_parser("reload", help="re-read the config file").set_defaults(func=_ctl, path="/admin/reload")
    sub.add_parser("rollback", help="return to the previous config version").set_defaults(
        func=_ctl, path="/admin/rollback")
    sub.add_parser("drain", help="stop accepting, finish in-flight requests, exit").set_defaults(
        func=_ctl, path="/admin/drain")
    sub.add_parser("config", help="show the running config").set_defaults(func=_ctl, path="/admin/config")
    w = sub.add_parser("weights", help="set a route's target weights: ROUTE TARGET=PCT ...")
    w.add_argument("route")
    w.add_argument("weights", nargs="+", metavar="TARGET=PCT")
    w.set_defaults(func=_ctl, path="/admin/weights")

    from gateway.billing.commands import register as register_usage   # `tandem usage`, `tandem cost estimate`
    register_usage(subparsers)


def _serve(args) -> int:
    from gateway.http.server import serve   # lazy (as below): each command loads only what it uses; `tandem` starts fast

    return serve(args.config, args.host, args.port, args.insecure, start_engine=not args.no_engine)


def _explain(args) -> int:
    from gateway.config.compile import load_config_or_report
    from gateway.errors import ClientError
    from gateway.request.validate import check_request, estimate_prompt_tokens
    from policies import ReplicaLoad, RequestFeatures, Signals, decide, prefix_text

    if (compiled := load_config_or_report(args.config)) is None:
        return 2
    try:
        with open(args.request, encoding="utf-8") as f:
            body = json.load(f)
    except OSError as e:
        print(f"--request {args.request}: cannot read it: {e.strerror or e}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"--request {args.request}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
              file=sys.stderr)
        return 2
    if not isinstance(body, dict):
        print(f"--request {args.request}: must hold one JSON object (a chat or completion body)", file=sys.stderr)
        return 2
    headers = {}
    for h in args.header:
        name, _, value = h.partition("=")
        headers[name.strip().lower()] = value.strip()
    endpoint = "chat/completions" if "messages" in body else "completions"
    try:
        p = check_request(body, endpoint, headers.get("x-priority"), compiled.local_serves)
    except ClientError as e:
        print(f"request rejected: {e.status} {e.message}", file=sys.stderr)
        return 1
    public = compiled.model_names.get(p.model)
    if public is None:
        print(f"request rejected: 404 unknown model {p.model!r}", file=sys.stderr)
        return 1
    unavailable = {}
    for name, b in compiled.config.backends.items():
        if b.type == "openai" and b.api_key_env and not os.environ.get(b.api_key_env):
            unavailable[name] = f"environment variable {b.api_key_env} is unset"
    features = RequestFeatures(
        model=public, priority=p.priority, prompt_tokens=estimate_prompt_tokens(body), tenant=args.tenant,
        has_tools=p.has_tools, has_response_format=p.has_response_format, headers=headers, metadata=p.metadata,
        user=p.user, request_id=args.request_id, stream=p.stream, max_tokens=p.max_tokens,
        local_serves=p.local_unsupported is None, prefix_text=prefix_text(body))
    signals = Signals(args.waiting, args.running, args.kv_usage, unavailable)
    for item in args.replica_load:
        name, _, n = item.partition("=")
        try:
            signals.replica_load[name] = ReplicaLoad(alive=False) if n == "dead" else ReplicaLoad(running=float(n))
        except ValueError:
            print(f"--replica-load: expected TARGET=N or TARGET=dead, got {item!r}", file=sys.stderr)
            return 2
    decision = decide(compiled.policy, features, signals, explain=True)
    if args.json:
        print(json.dumps(decision.to_dict(), indent=2))
    else:
        print(f"model: {p.model} -> {public}; priority {p.priority}; ~{features.prompt_tokens} prompt tokens "
              "(estimate: 4 chars/token)")
        print(decision.explain())
        if p.local_unsupported:
            print(f"note: '{p.local_unsupported}' is not served by the local engine: a local first target -> 400")
        elif p.has_tools or p.has_response_format:
            print(f"note: the local engine serves {', '.join(sorted(compiled.local_serves))} "
                  "(grammar-constrained decoding); local.serves = true")
    return 0


def _ctl(args) -> int:
    from gateway.http.admin_client import admin_call

    body = None
    if args.path == "/admin/weights":
        weights = {}
        for item in args.weights:
            name, sep, pct = item.partition("=")
            try:
                weights[name] = float(pct.rstrip("%"))
            except ValueError:
                sep = ""
            if not sep:
                print(f"tandem ctl weights: expected TARGET=PCT, got {item!r}", file=sys.stderr)
                return 2
        body = {"route": args.route, "weights": weights}
    method = "GET" if args.path == "/admin/config" else "POST"
    code, data = admin_call("tandem ctl", args.url, args.token_env, method, args.path, body=body)
    if code:
        return code
    if isinstance(data, dict) and "routes" in data and args.path != "/admin/config":
        print(_version_summary(data))
    else:
        print(json.dumps(data, indent=2) if not isinstance(data, str) else data)
    return 0


def _version_summary(data: dict) -> str:
    """A new config version as ``tandem ctl weights/rollback/reload`` print it: the version, each route's
    weights and shares, then the warnings."""
    lines = [f"config version {data.get('version')} ({data.get('source')})"
             + ("" if data.get("propagated", True) else ", not shared yet (Redis unreachable)")]
    for name, r in data["routes"].items():
        targets = ", ".join(f"{t['id']}={t['weight']:g} ({t['share_pct']:g} %)" for t in r["targets"])
        fallbacks = f"; fallbacks: {', '.join(r['fallbacks'])}" if r["fallbacks"] else ""
        lines.append(f"  route {name} [{r['select']}]: {targets}{fallbacks}")
    lines += [f"warning: {w}" for w in data.get("warnings", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The gateway's commands alone (``python -m gateway.commands serve ...``),
    independent of the other areas' sub-commands."""
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
