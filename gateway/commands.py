"""The gateway's ``tandem`` sub-commands: ``serve``, ``route explain``,
``ctl`` (reload, rollback, weights, drain, config, rollout via the admin API), and
``usage`` / ``cost estimate`` (from ``gateway/billing/commands.py``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace

from gateway.config import EXAMPLE_CONFIG


def _register_serve(subparsers) -> None:
    """``tandem serve`` and its flags."""
    p = subparsers.add_parser("serve", help="run the gateway (with the in-process engine)")
    p.add_argument("--config", default=EXAMPLE_CONFIG, help="YAML config file (default: the shipped example, "
                   "the repository's config.example.yaml, as `make serve`: copy it to change it)")
    p.add_argument("--host", default=None, help="bind address (default: server.host)")
    p.add_argument("--port", type=_port, default=None, help="TCP port, 0-65535 (default: server.port)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback bind without virtual keys (default: server.insecure)")
    p.add_argument("--no-engine", action="store_true",
                   help="do not start the local engine (upstreams only; the local backend stays unavailable)")
    p.add_argument("--picker-port", type=int, default=None,
                   help="also serve as the Gateway API Inference Extension's endpoint picker: Envoy's ext_proc "
                        "over gRPC on this port (the inference extension's is 9002; docs/operators/scale-out.md)")
    p.add_argument("--picker-health-port", type=int, default=None,
                   help="with --picker-port: the gRPC health service on this port too (the extension's is 9003)")
    p.add_argument("--picker-fallbacks", type=int, default=0,
                   help="with --picker-port: endpoints sent after the primary, comma-separated (default 0: Envoy's "
                        "ORIGINAL_DST cluster reads one address; a list needs e.g. its override_host policy)")
    p.set_defaults(func=_serve)


def register(subparsers) -> None:
    """Add ``serve``, ``route`` and ``ctl`` to the ``tandem`` parser."""
    _register_serve(subparsers)

    p = subparsers.add_parser("route", help="routing policy tools")
    sub = p.add_subparsers(dest="route_command", required=True)
    e = sub.add_parser("explain", help="print the routing decision for a request, sending nothing")
    e.add_argument("--config", help="the gateway's YAML config file: the decision it would make at start")
    e.add_argument("--url", help="a running gateway's base URL: the decision it would make now (its live weights, "
                                 "breakers, keys and engine load, through the admin API)")
    e.add_argument("--token-env", default="TANDEM_ADMIN_TOKEN",
                   help="with --url: environment variable holding the admin token (default: TANDEM_ADMIN_TOKEN)")
    e.add_argument("--request", required=True, help="JSON file with the request body")
    e.add_argument("--endpoint", default=None, choices=("chat/completions", "completions", "embeddings", "messages",
                                                         "responses"),
                   help="the endpoint the body is for (default: chat with messages, completions with prompt, "
                        "embeddings with input); messages and responses are routed as their chat translations")
    e.add_argument("--header", action="append", default=[], metavar="NAME=VALUE", help="request header (repeat)")
    e.add_argument("--tenant", default="", help="tenant of the virtual key (default: the one of the key in "
                                                "--header authorization=..., else anonymous)")
    e.add_argument("--waiting", type=int, default=0, help="local engine signal: waiting requests, count")
    e.add_argument("--running", type=int, default=0, help="local engine signal: running requests, count")
    e.add_argument("--kv-usage", type=float, default=0.0, help="local engine signal: KV-cache usage, percent (0-100)")
    e.add_argument("--request-id", default="explain",
                   help="request id: the canary key when the request has no user or key")
    e.add_argument("--replica-load", action="append", default=[], metavar="TARGET=N",
                   help="prefix_affinity routes: requests running + waiting on that replica (repeat; default 0; "
                        "'TARGET=dead' for one whose metrics do not answer)")
    e.add_argument("--ttft", action="append", default=[], metavar="BACKEND=SECONDS",
                   help="a backend's predicted TTFT for slo routes (repeatable; default: no estimate)")
    e.add_argument("--json", action="store_true", help="print the decision as JSON")
    e.set_defaults(func=_explain)

    p = subparsers.add_parser("ctl", help="control a running gateway through its admin API")
    p.add_argument("--url", default=os.environ.get("TANDEM_URL", "http://127.0.0.1:8000"),
                   help="the gateway's base URL (default: $TANDEM_URL, else http://127.0.0.1:8000)")
    p.add_argument("--token-env", default="TANDEM_ADMIN_TOKEN",
                   help="environment variable holding the admin token (default: TANDEM_ADMIN_TOKEN)")
    sub = p.add_subparsers(dest="ctl_command", required=True)
    rl = sub.add_parser("reload", help="re-read the config file")
    rl.add_argument("--abort-rollouts", action="store_true",
                    help="end the rollouts the new file would orphan (else the reload is refused naming them)")
    rl.set_defaults(func=_ctl, path="/admin/reload")
    sub.add_parser("status", help="each route's effective weights and the layer that decides them").set_defaults(
        func=_ctl, path="/admin/config", status=True)
    rb = sub.add_parser("rollback", help="return to the previous config version")
    rb.add_argument("--base-version", type=int, help="the version to undo (409 when the head is another one)")
    rb.add_argument("--restore-keys", action="store_true",
                    help="let virtual keys the undone change removed come back (else the rollback is refused)")
    rb.set_defaults(func=_ctl, path="/admin/rollback")
    sub.add_parser("drain", help="stop accepting, finish in-flight requests, exit").set_defaults(
        func=_ctl, path="/admin/drain")
    sub.add_parser("config", help="show the running config").set_defaults(func=_ctl, path="/admin/config")
    w = sub.add_parser("weights", help="set a route's target weights: ROUTE TARGET=PCT ...")
    w.add_argument("route")
    w.add_argument("weights", nargs="+", metavar="TARGET=PCT")
    w.add_argument("--base-version", type=int, help="the version the change is built on (409 when it is not the head)")
    w.add_argument("--rebase", action="store_true", help="apply the change on top of the shared head, whatever it is")
    w.set_defaults(func=_ctl, path="/admin/weights")
    from gateway.rollouts.commands import register as register_rollout   # `tandem ctl rollout ...`
    register_rollout(sub)

    from gateway.billing.commands import register as register_usage   # `tandem usage`, `tandem cost estimate`
    register_usage(subparsers)


def _serve(args) -> int:
    from gateway.http.server import serve   # lazy (as below): each command loads only what it uses; `tandem` starts fast

    return serve(args.config, args.host, args.port, args.insecure, start_engine=not args.no_engine,
                 picker_port=args.picker_port, picker_health_port=args.picker_health_port,
                 picker_fallbacks=args.picker_fallbacks)


def _prompt_tokens(compiled, endpoint: str, body: dict) -> tuple[int, int, str]:
    """The prompt length the gateway would route on (all prompts, the longest of a batch), and how it was
    counted: the local engine's rendering (its chat template and tokenizer) when a rule reads ``prompt_tokens``
    and a local backend is configured, as ``tandem serve`` counts once its engine is up; else the estimate."""
    from gateway.request.validate import prompt_counts

    local = next((b for b in compiled.config.backends.values() if b.type == "local"), None)
    if local is not None and "prompt_tokens" in compiled.policy.fields():
        # the tokenizer only (no weights): lazy, only this case pays the engine import
        import os.path

        from engine.config import default_model_path
        from engine.protocol.errors import ServingError
        from engine.tokenizer import Tokenizer
        from gateway.backends.local import render_prompt

        try:
            path = local.engine.model or default_model_path()
            tok = Tokenizer.from_hf_dir(path) if os.path.isdir(path) else Tokenizer.from_gguf(path)
            return (*prompt_counts(body, render_prompt(tok, endpoint, body), local.engine.max_model_len),
                    "the local engine's rendering, as the gateway counts")
        except (OSError, ValueError) as e:
            print(f"note: the local engine's tokenizer could not be loaded ({e}); using the estimate",
                  file=sys.stderr)
        except ServingError as e:
            print(f"note: the local engine would refuse this body ({e.message}); using the estimate",
                  file=sys.stderr)
    return (*prompt_counts(body), "estimate: 4 chars/token")


def _read_request(path: str) -> dict | None:
    """The JSON object in ``path`` (a chat or completion body); None after printing why not."""
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except OSError as e:
        print(f"--request {path}: cannot read it: {e.strerror or e}", file=sys.stderr)
        return None
    except json.JSONDecodeError as e:
        print(f"--request {path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", file=sys.stderr)
        return None
    if not isinstance(body, dict):
        print(f"--request {path}: must hold one JSON object (a chat or completion body)", file=sys.stderr)
        return None
    return body


def _explain_live(args, body: dict, headers: dict) -> int:
    """``route explain --url``: the running gateway's decision now (``POST /admin/explain``)."""
    from gateway.http.admin_client import admin_call

    spec = {"request": body, "headers": headers, "tenant": args.tenant, "request_id": args.request_id,
            "endpoint": args.endpoint}
    code, data = admin_call("tandem route explain", args.url, args.token_env, "POST", "/admin/explain", body=spec)
    if code:
        return code
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"model: {data['model']} -> {data['public_model']}; priority {data['priority']}; "
          f"{data['prompt_tokens']} prompt tokens; tenant {data['tenant'] or 'anonymous'}; "
          f"config version {data['config_version']}")
    print(data["explanation"])
    for target, state in data["breakers"].items():
        print(f"breaker {target}: {state}" + (" (skipped until it half-opens)" if state == "open" else ""))
    for backend, why in data["unavailable"].items():
        print(f"unavailable {backend}: {why}")
    return 0


def _given_signals(args, unavailable: dict[str, str]):
    """``route explain --config``'s live signals as its flags give them (``policies.Signals``); None after saying
    which ``--replica-load`` or ``--ttft`` value is malformed."""
    from policies import ReplicaLoad, Signals, TTFTEstimate

    signals = Signals(args.waiting, args.running, args.kv_usage, unavailable)
    for item in args.replica_load:
        name, _, n = item.partition("=")
        try:
            signals.replica_load[name] = ReplicaLoad(alive=False) if n == "dead" else ReplicaLoad(running=float(n))
        except ValueError:
            print(f"--replica-load: expected TARGET=N or TARGET=dead, got {item!r}", file=sys.stderr)
            return None
    for item in args.ttft:
        name, _, sec = item.partition("=")
        try:
            signals.ttft[name] = TTFTEstimate(float(sec), "given with --ttft")
        except ValueError:
            print(f"--ttft: expected BACKEND=SECONDS, got {item!r}", file=sys.stderr)
            return None
    return signals


def _explain(args) -> int:
    from gateway.config.compile import load_config_or_report
    from gateway.errors import ClientError
    from gateway.request.auth import authenticate
    from gateway.request.pipeline import explained_form, tenant_priority, upstream_only_error
    from gateway.request.validate import check_request
    from policies import RequestFeatures, decide, prefix_text

    if bool(args.config) == bool(args.url):
        print("tandem route explain: give --config FILE (the decision at start) or --url URL (the running "
              "gateway's decision now)", file=sys.stderr)
        return 2
    if (body := _read_request(args.request)) is None:
        return 2
    headers = {}
    for h in args.header:
        name, _, value = h.partition("=")
        headers[name.strip().lower()] = value.strip()
    if args.url:
        return _explain_live(args, body, headers)
    if (compiled := load_config_or_report(args.config)) is None:
        return 2
    try:
        endpoint, body, _ = explained_form(body, args.endpoint)
        # the key's tenant, as the gateway reads it (a policy trial's --header authorization=... was unread)
        tenant = args.tenant or (authenticate(headers["authorization"], compiled.key_hashes)
                                 if headers.get("authorization") and compiled.key_hashes else "")
        p = check_request(body, endpoint, headers.get("x-priority"), compiled.local_serves)
        p = replace(p, priority=tenant_priority(p.priority, tenant, compiled.config.limits))
    except ClientError as e:
        print(f"request rejected: {e.status} {e.message}", file=sys.stderr)
        return 1
    public = compiled.model_names.get(p.model)
    if public is None:
        print(f"request rejected: 404 unknown model {p.model!r}", file=sys.stderr)
        return 1
    unavailable = {}
    for name, b in compiled.config.backends.items():
        if b.type in ("openai", "anthropic") and b.api_key_env and not os.environ.get(b.api_key_env):
            unavailable[name] = f"environment variable {b.api_key_env} is unset"
    prompt_tokens, longest, counted_by = _prompt_tokens(compiled, endpoint, p.body)
    features = RequestFeatures(
        model=public, priority=p.priority, prompt_tokens=prompt_tokens, longest_prompt_tokens=longest,
        tenant=tenant,
        has_tools=p.has_tools, has_response_format=p.has_response_format, headers=headers, metadata=p.metadata,
        user=p.user, request_id=args.request_id, stream=p.stream, max_tokens=p.max_tokens,
        local_serves=p.local_unsupported is None, prefix_text=prefix_text(body))
    if (signals := _given_signals(args, unavailable)) is None:
        return 2
    if args.ttft and not compiled.policy.has_slo():
        print("note: --ttft is read by routes and rules with `slo:` only, and this config has none "
              "(config.example.yaml's `local-slo` route is commented out)", file=sys.stderr)
    decision = decide(compiled.policy, features, signals, explain=True)
    if args.json:
        print(json.dumps(decision.to_dict(), indent=2))
    else:
        print(f"model: {p.model} -> {public}; priority {p.priority}; {features.prompt_tokens} prompt tokens "
              f"({counted_by})")
        print(decision.explain())
        if p.local_unsupported:
            upstreams = {name: unavailable.get(name, "") for name, b in compiled.config.backends.items()
                         if b.type != "local"}
            refusal = upstream_only_error(p.local_unsupported, decision, compiled.policy.routes.get(decision.route),
                                          upstreams, keyless=unavailable)   # every one of them: its key unset
            print(f"note: '{p.local_unsupported}' is not served by the local engine: " + (
                f"{refusal.status} {refusal.code}: {refusal.message}" if refusal else "the local targets are skipped"))
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
                value = float(pct.rstrip("%"))
            except ValueError:
                value = math.nan
            if not sep or not math.isfinite(value):
                print(f"tandem ctl weights: expected TARGET=PCT, PCT a finite number, got {item!r}", file=sys.stderr)
                return 2
            if name in weights:
                print(f"tandem ctl weights: target {name!r} given twice", file=sys.stderr)
                return 2
            weights[name] = value
        body = {"route": args.route, "weights": weights, "rebase": args.rebase}
    if getattr(args, "abort_rollouts", False):
        body = {"abort_rollouts": True}
    if getattr(args, "restore_keys", False):
        body = {"restore_keys": True}
    if getattr(args, "base_version", None) is not None:
        body = {**(body or {}), "base_version": args.base_version}
    method = "GET" if args.path == "/admin/config" else "POST"
    code, data = admin_call("tandem ctl", args.url, args.token_env, method, args.path, body=body)
    if code:
        return code
    if getattr(args, "status", False):
        print(layers_summary(data))
    elif args.path == "/admin/drain":
        print(f"draining: {data['in_flight']} request(s) in flight are answered first, new ones get 503; the gateway "
              "exits when they are done")
    elif isinstance(data, dict) and "routes" in data and args.path != "/admin/config":
        print(_version_summary(data))
    else:
        print(json.dumps(data, indent=2) if not isinstance(data, str) else data)
    return 0


def _version_summary(data: dict) -> str:
    """A new config version as ``tandem ctl weights/rollback/reload`` print it: the version, each route's
    weights and shares (and, when a weighted target is out, what its requests get now), then the warnings."""
    # propagated None: no Redis configured, nothing to share with (a change Redis cannot take is refused, 503)
    shared = "" if data.get("propagated", True) else ", this gateway only (no Redis configured)"
    lines = [f"config version {data.get('version')} ({data.get('source')})" + shared
             + (": unchanged, the change is the config it runs" if data.get("unchanged") else "")]
    if data.get("returned_to") is not None:     # a rollback says what it undid (an ops trial read only the number)
        lines.append(f"  returns to version {data['returned_to']}: {data.get('changes') or 'no change'}")
    for name, r in data["routes"].items():
        # a share only where the weights set the traffic; elsewhere (cheapest, slo) a weight makes a choice or a spare
        targets = ", ".join(f"{t['id']}={t['weight']:g} ({t['share_pct']:g} %)" if r.get("weights_steer", True)
                            else f"{t['id']}={t['weight']:g} ({'choice' if t['weight'] > 0 else 'spare'})"
                            for t in r["targets"])
        fallbacks = f"; fallbacks: {', '.join(r['fallbacks'])}" if r["fallbacks"] else ""
        lines.append(f"  route {name} [{r['select']}]: {targets}{fallbacks}")
        if now := _traffic_now(r):
            lines.append(f"    now: {now}")
    lines += [f"  {v['note']}" for v in (data.get("layers") or {}).values() if v["note"]]
    lines += [f"warning: {w}" for w in data.get("warnings", [])]
    return "\n".join(lines)


def layers_summary(data: dict) -> str:
    """``tandem ctl status``: per route its effective weights, the layer that decides them and what it
    overrides (``gateway/config/layers.py``)."""
    lines = [f"config version {data.get('version')} ({data.get('source')}), file: {data['file']['status']}"]
    if data.get("draining"):   # an SRE trial's `ctl status` during a drain looked like any other moment
        lines.append(f"  draining: {data.get('in_flight', 0)} request(s) in flight, new ones get 503")
    if data.get("redis_degraded"):
        lines.append("  redis unreachable: serving on in-process state; config changes wait for it")
    for name, v in (data.get("layers") or {}).items():
        eff = ", ".join(f"{k} {w:g}" for k, w in v["effective"].items())
        lines.append(f"  route {name}: {eff}  [{v['decided_by']}]" + (f"  ({v['note']})" if v["note"] else ""))
        if now := _traffic_now(data.get("routes", {}).get(name)):
            lines.append(f"    now: {now}")
    return "\n".join(lines)


def _traffic_now(route: dict | None) -> str:
    """What a route's requests get now when a target with weight is out (``add_effective_shares``'
    ``effective_pct`` and ``out``): ``local-f32 out (breaker open); local 100 %``; "" when every weighted
    target serves (the weights are the shares)."""
    route = route or {}
    out = [f"{t['id']} out ({t['out']})" for t in route.get("targets", []) if t.get("out") and t["weight"] > 0]
    if not out:
        return ""
    serving = [f"{t['id']} {t['effective_pct']:g} %" for t in route["targets"] if t.get("effective_pct")]
    fallbacks = ", ".join(route.get("fallbacks", []))
    none = f"no target serves: its fallbacks ({fallbacks}) in order, then 503" if fallbacks else "no target serves: 503"
    return "; ".join(out + [", ".join(serving) or none])


def _port(value: str) -> int:
    """``--port``'s type: ``engine.arg_values.tcp_port`` (imported when a port is given: ``tandem`` starts fast)."""
    from engine.arg_values import flag_type, tcp_port

    return flag_type(tcp_port)(value)


def main(argv: list[str] | None = None) -> int:
    """The gateway's commands alone (``python -m gateway.commands serve ...``),
    independent of the other areas' sub-commands."""
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
