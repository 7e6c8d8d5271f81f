"""The usage report's rows (``UsageLedger.report``): the per-day usage hashes, one field per backend and counter
(``<backend>|<field>``), summed per tenant and backend, with the totals."""

from __future__ import annotations

from gateway.billing.prices import NANO

# the counters of a usage hash: requests, prompt / completion / cached tokens, nano-USD, failed requests
FIELDS = ("req", "in", "out", "cached", "nusd", "fail")


def usage_rows(raw: dict[str, list[dict]]) -> tuple[dict[str, dict], dict]:
    """Per tenant (those with usage only) its backends' rows and its own sums, and the totals over all, from
    ``raw``: tenant -> its days' usage hashes (field ``<backend>|<counter>`` -> count, as Redis or the process
    keeps them). A row: requests, failed_requests, prompt/completion/cached tokens, cost_usd."""
    tenants: dict[str, dict] = {}
    total = {f: 0 for f in FIELDS}
    for t, hashes in raw.items():
        backends: dict[str, dict[str, int]] = {}
        for h in hashes:
            for k, v in h.items():
                b, _, f = k.rpartition("|")
                if f in FIELDS:
                    row = backends.setdefault(b, {x: 0 for x in FIELDS})
                    row[f] += int(v)
        if not backends:
            continue
        tsum = {f: sum(row[f] for row in backends.values()) for f in FIELDS}
        for f in FIELDS:
            total[f] += tsum[f]
        tenants[t] = {"backends": {b: _row(row) for b, row in sorted(backends.items())}, **_row(tsum)}
    return tenants, _row(total)


def _row(r: dict[str, int]) -> dict:
    return {"requests": r["req"], "failed_requests": r["fail"], "prompt_tokens": r["in"],
            "completion_tokens": r["out"], "cached_tokens": r["cached"], "cost_usd": r["nusd"] / NANO}
