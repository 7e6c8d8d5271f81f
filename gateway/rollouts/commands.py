"""``tandem ctl rollout start|status|pause|resume|promote|abort|release`` over the rollouts admin API
(``gateway/http/rollouts_admin.py``), and the text ``status`` prints."""

from __future__ import annotations

import json
import sys


def register(ctl_sub) -> None:
    """Add ``rollout`` to ``tandem ctl``'s sub-commands."""
    p = ctl_sub.add_parser("rollout", help="gated progressive rollouts: start, status, pause, resume, promote, abort, "
                                                "release")
    sub = p.add_subparsers(dest="rollout_command", required=True)
    s = sub.add_parser("start", help="start a rollout: NAME ROUTE CANDIDATE [--steps 5,25,100] [--hold-s S] ...")
    s.add_argument("name")
    s.add_argument("route")
    s.add_argument("candidate", help="a target id of the route")
    s.add_argument("--baseline", default="", help="the target giving up the weight (default: the route's first other)")
    s.add_argument("--steps", default="5,25,100", help="candidate percentages, in order")
    s.add_argument("--hold-s", type=float, default=300.0, help="seconds every gate must hold at a step")
    s.add_argument("--gate", action="append", default=[], metavar="NAME=VALUE",
                   help="parity_min, error_rate_max, ttft_p95_max_ms, ttft_p50_ratio_max, tpot_p50_max_ms, "
                        "min_compared (repeat)")
    s.add_argument("--sample-percent", type=float, default=100.0, help="share of the route's requests compared")
    s.set_defaults(func=_start)
    st = sub.add_parser("status", help="rollouts with their gates and parity (and every shadow's parity)")
    st.add_argument("name", nargs="?", help="one rollout (default: all)")
    st.add_argument("--json", action="store_true", help="print the admin API's JSON")
    st.set_defaults(func=_status)
    helps = {"release": "hand a promoted rollout's route back to the file and operators (docs/operators/desired-state.md)"}
    for action in ("pause", "resume", "promote", "abort", "release"):
        a = sub.add_parser(action, help=helps.get(action, f"{action} a rollout"))
        a.add_argument("name")
        a.set_defaults(func=_action, action=action)


def _call(args, method: str, path: str, body: dict | None = None):
    from gateway.http.admin_client import admin_call

    return admin_call("tandem ctl rollout", args.url, args.token_env, method, path, body=body)


def _start(args) -> int:
    gates = {}
    for item in args.gate:
        k, sep, v = item.partition("=")
        try:
            gates[k] = int(v) if k == "min_compared" else float(v)
        except ValueError:
            sep = ""
        if not sep:
            print(f"tandem ctl rollout start: --gate expects NAME=NUMBER, got {item!r}", file=sys.stderr)
            return 2
    try:
        steps = [float(x) for x in args.steps.split(",")]
    except ValueError:
        print(f"tandem ctl rollout start: --steps: expected percentages like 5,25,100, got {args.steps!r}",
              file=sys.stderr)
        return 2
    body = {"name": args.name, "route": args.route, "candidate": args.candidate, "baseline": args.baseline,
            "steps": steps, "hold_s": args.hold_s, "gates": gates, "sample_percent": args.sample_percent}
    code, data = _call(args, "POST", "/admin/rollouts", body)
    if not code:
        print(format_rollout(data))
    return code


def _action(args) -> int:
    code, data = _call(args, "POST", f"/admin/rollouts/{args.name}/{args.action}")
    if not code:
        print(format_rollout(data))
    return code


def _status(args) -> int:
    code, data = _call(args, "GET", "/admin/rollouts")
    if code:
        return code
    code, parity = _call(args, "GET", "/admin/parity")
    if code:
        return code
    rollouts = [r for r in data["rollouts"] if args.name in (None, r["name"])]
    if args.name and not rollouts:
        print(f"tandem ctl rollout status: no rollout {args.name!r}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"rollouts": rollouts, "parity": parity["reports"]}, indent=2))
        return 0
    names = {r["name"] for r in data["rollouts"]}
    out = [format_rollout(r) for r in rollouts]
    if args.name is None:
        out += [f"shadow {n}:\n{format_parity(p)}" for n, p in parity["reports"].items() if n not in names]
    print("\n\n".join(out) if out else "no rollouts or shadows")
    return 0


def _num(x, fmt: str = ".4g") -> str:
    return "-" if x is None else format(x, fmt)


def format_parity(p: dict | None, indent: str = "  ") -> str:
    """A parity report ``P`` in a few lines."""
    if not p:
        return f"{indent}parity: no pairs compared yet"
    lines = [f"{indent}parity ({p['kind']}): {p['compared']}/{p['requests']} pairs compared, "
             f"{p['shadow_dropped']} dropped; exact {_num(p['exact_share'])}, token agreement "
             f"{_num(p['token_agreement'])}, first divergence p50 {_num(p['first_divergence']['p50'])} "
             f"p90 {_num(p['first_divergence']['p90'])}, logprob delta p50 {_num(p['logprob_delta_p50'])}, "
             f"mean KL {_num(p['mean_kl'])}, length ratio {_num(p['length_ratio'])}"]
    for side in ("primary", "candidate"):
        s = p[side]
        lines.append(f"{indent}  {side}: error rate {s['error_rate']:.3g}, TTFT p50 {_num(s['ttft_p50_ms'], '.1f')} "
                     f"p95 {_num(s['ttft_p95_ms'], '.1f')} ms, TPOT p50 {_num(s['tpot_p50_ms'], '.2f')} ms")
    return "\n".join(lines)


def format_rollout(r: dict) -> str:
    """A rollout (the admin API's R) as ``tandem ctl rollout`` prints it."""
    steps = " -> ".join(("[" + f"{s:g}" + "]") if i == r["step_index"] else f"{s:g}" for i, s in enumerate(r["steps"]))
    lines = [f"rollout {r['name']}: {r['state']}, route {r['route']}: {r['candidate']} {r['weight']:g} % "
             f"(baseline {r['baseline']}), steps {steps}, hold {r['hold_s']:g} s"]
    if r["reason"]:
        lines.append(f"  last change: {r['reason']}")
    for name, g in r["gates"].items():
        ok = {True: "holds", False: "FAILS", None: "not judged yet"}[g["ok"]]
        lines.append(f"  gate {name}: {_num(g['value'])} (limit {g['limit']:g}): {ok}")
    lines.append(format_parity(r["parity"]))
    lines += [f"warning: {w}" for w in r.get("warnings", ())]
    return "\n".join(lines)
