"""``tandem usage`` (a running gateway's per-tenant usage, from ``GET /admin/usage``) and ``tandem cost estimate``
(monthly cost of a workload on each configured target, from the backends' prices)."""

from __future__ import annotations

import json
import os
import sys

from gateway.billing.prices import Price, format_usd, monthly_cost_usd
from gateway.config import EXAMPLE_CONFIG
from gateway.http.admin_client import admin_call


def register(subparsers) -> None:
    """Add ``tandem usage`` and ``tandem cost estimate`` to the ``tandem`` parser."""
    p = subparsers.add_parser("usage", help="per-tenant usage and cost of a running gateway (GET /admin/usage)")
    p.add_argument("--url", default=os.environ.get("TANDEM_URL", "http://127.0.0.1:8000"),
                   help="the gateway's base URL (default: $TANDEM_URL, else http://127.0.0.1:8000)")
    p.add_argument("--token-env", default="TANDEM_ADMIN_TOKEN",
                   help="environment variable holding the admin token (default: TANDEM_ADMIN_TOKEN)")
    p.add_argument("--tenant", default=None, help="one tenant (default: all)")
    p.add_argument("--since", default=None, help="first UTC day: YYYY-MM-DD or Nd (N days back) (default: today)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_usage_command)

    p = subparsers.add_parser("cost", help="cost tools")
    sub = p.add_subparsers(dest="cost_command", required=True)
    e = sub.add_parser("estimate", help="monthly cost of a workload on each configured target")
    e.add_argument("--config", default=EXAMPLE_CONFIG,
                   help="gateway YAML config (its backends' prices) (default: the example config, config.example.yaml)")
    e.add_argument("--tokens-per-month", type=float, required=True,
                   help="prompt + completion tokens per month (e.g. 1e9)")
    e.add_argument("--input-share", type=float, default=0.75, help="fraction of the tokens that are prompt tokens, 0-1")
    e.add_argument("--json", action="store_true", help="print the table as JSON")
    e.set_defaults(func=_cost_estimate_command)


HOURS_PER_MONTH = 730            # 8,760 hours a year / 12


def cost_table(config, tokens_per_month: int, input_share: float = 0.75) -> list[dict]:
    """One row per distinct target (backend, upstream model) of the config's
    routes, cheapest first: prices (USD per million tokens) and monthly USD; a local engine with ``cost`` its
    machine's month (``usd_per_hour`` x ``HOURS_PER_MONTH``) whatever it serves, its prices None (they follow its
    load: a FinOps trial's estimate priced a 36 USD/h machine by its placeholder ``prices``)."""
    seen: dict[tuple[str, str], dict] = {}
    for route in config.routes.values():
        for t in (*route.targets, *route.fallbacks):
            b = config.backends.get(t.backend)
            if b is None:
                continue
            model = t.model or (", ".join(sorted(set(b.models.values()))) if getattr(b, "models", None) else "")
            if b.type == "local":
                model = model or (b.engine.served_model_name or "local engine")
            key = (t.backend, model)
            if key in seen:
                continue
            price = Price.of(b.prices)
            machine = getattr(b, "cost", None)
            seen[key] = {"target": t.id or (f"{t.backend}/{t.model}" if t.model else t.backend), "backend": t.backend,
                         "model": model, "input_usd_per_mtok": None if machine else price.input,
                         "output_usd_per_mtok": None if machine else price.output,
                         "monthly_usd": machine.usd_per_hour * HOURS_PER_MONTH if machine
                         else monthly_cost_usd(price, tokens_per_month, input_share)}
    return sorted(seen.values(), key=lambda r: (r["monthly_usd"], r["target"]))


def _cost_estimate_command(args) -> int:
    from gateway.config.compile import load_config_or_report   # lazy: pydantic costs every `tandem` start ~0.2 s

    if (compiled := load_config_or_report(args.config)) is None:
        return 2
    if not 0.0 <= args.input_share <= 1.0 or args.tokens_per_month < 0:
        print("tandem cost estimate: --input-share must be within [0, 1] and --tokens-per-month >= 0", file=sys.stderr)
        return 2
    rows = cost_table(compiled.config, int(args.tokens_per_month), args.input_share)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    n = int(args.tokens_per_month)
    print(f"{n:,} tokens/month, {args.input_share:.0%} input / {1 - args.input_share:.0%} output "
          f"(prices: USD per million tokens, from {args.config})")
    w = max([len("target")] + [len(r["target"]) for r in rows])
    wm = max([len("model")] + [len(r["model"]) for r in rows])
    print(f"{'target':<{w}}  {'model':<{wm}}  {'input':>8}  {'output':>8}  {'USD/month':>14}")
    for r in rows:
        prices = [f"{p:>8.4g}" if p is not None else f"{'machine':>8}"
                  for p in (r["input_usd_per_mtok"], r["output_usd_per_mtok"])]
        print(f"{r['target']:<{w}}  {r['model']:<{wm}}  {prices[0]}  {prices[1]}  {r['monthly_usd']:>14,.2f}")
    return 0


def _usage_command(args) -> int:
    params = {k: v for k, v in (("tenant", args.tenant), ("since", args.since)) if v}
    code, data = admin_call("tandem usage", args.url, args.token_env, "GET", "/admin/usage", params=params)
    if code:
        return code
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    if data.get("partial"):
        print(f"tandem usage: partial: {data['partial']}", file=sys.stderr)
    print(f"usage {data['since']} .. {data['until']} (UTC)" + (" (partial)" if data.get("partial") else ""))
    print(f"{'tenant':<20} {'backend':<16} {'requests':>9} {'failed':>7} {'prompt':>12} {'completion':>12} "
          f"{'USD':>14}")
    rows = [(t, b, br) for t, row in data["tenants"].items() for b, br in row["backends"].items()]
    for t, b, r in [*rows, ("total", "", data)]:
        print(f"{t:<20} {b:<16} {r['requests']:>9} {r.get('failed_requests', 0):>7} {r['prompt_tokens']:>12} "
              f"{r['completion_tokens']:>12} {r['cost_usd']:>14.6f}")
    for t, b in (data.get("budgets") or {}).items():
        used = (b["spent_usd"] + b["reserved_usd"]) / b["budget_usd"] if b["budget_usd"] else 0.0
        print(f"budget {t}: {format_usd(b['spent_usd'])} spent + {format_usd(b['reserved_usd'])} reserved of "
              f"{format_usd(b['budget_usd'])} per {b['period']} ({used:.1%})")
    return 0
