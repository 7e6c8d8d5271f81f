"""Prometheus series of the parity reports and rollouts, labelled by ``rollout`` (a rollout's name, or
``shadow/<route>`` for a route's shadow), read at scrape time from the reports ``refresh`` computed last:

- ``tandem_parity_compared{rollout}``: pairs compared (both sides answered); ``tandem_parity_requests{rollout}``;
- ``tandem_parity_exact_share{rollout}``, ``tandem_parity_token_agreement{rollout}``, ``tandem_parity_mean_kl
  {rollout}``, ``tandem_parity_length_ratio{rollout}``, ``tandem_parity_first_divergence_p50{rollout}``;
- ``tandem_parity_error_rate{rollout, side}``, ``tandem_parity_ttft_p95_seconds{rollout, side}``,
  ``tandem_parity_tpot_p50_seconds{rollout, side}`` (side: primary, candidate);
- ``tandem_rollout_weight{rollout, route, candidate}`` (percent; only while the rollout holds its route: running,
  paused, promoted, since an ended one's route is the file's or an operator's) and ``tandem_rollout_state{rollout,
  state}`` (1);
- ``tandem_shadow_requests_total{rollout, outcome}`` (sent, dropped): a counter of this process, in
  ``gateway/rollouts/shadow.py``.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from gateway.config.layers import HOLDING_STATES

_FIGURES = (("exact_share", "exact_share", "Share of compared pairs with bitwise identical token ids."),
            ("token_agreement", "token_agreement", "Positions where both sides chose the same token."),
            ("mean_kl", "mean_kl", "Mean KL(primary || candidate) over top-k logprobs, up to the first divergence."),
            ("length_ratio", "length_ratio", "Mean candidate / primary answer length."),
            ("compared", "compared", "Pairs compared (both sides answered)."),
            ("requests", "requests", "Pairs sent."))


class ParityCollector:
    """A collector over ``reports`` (name -> P) and ``rollouts`` (admin R views), set by ``refresh``."""

    def __init__(self):
        self.reports: dict[str, dict] = {}
        self.rollouts: list[dict] = []

    def describe(self):
        return []

    def collect(self):
        for key, name, doc in _FIGURES:
            g = GaugeMetricFamily(f"tandem_parity_{name}", doc, labels=["rollout"])
            for n, p in self.reports.items():
                if p.get(key) is not None:
                    g.add_metric([n], float(p[key]))
            yield g
        div = GaugeMetricFamily("tandem_parity_first_divergence_p50", "Median first divergent position.",
                                labels=["rollout"])
        for n, p in self.reports.items():
            if p["first_divergence"]["p50"] is not None:
                div.add_metric([n], float(p["first_divergence"]["p50"]))
        yield div
        err = GaugeMetricFamily("tandem_parity_error_rate", "Error rate of each side.", labels=["rollout", "side"])
        ttft = GaugeMetricFamily("tandem_parity_ttft_p95_seconds", "TTFT p95 of each side.", labels=["rollout", "side"])
        tpot = GaugeMetricFamily("tandem_parity_tpot_p50_seconds", "TPOT p50 of each side.", labels=["rollout", "side"])
        for n, p in self.reports.items():
            for side in ("primary", "candidate"):
                s = p[side]
                err.add_metric([n, side], s["error_rate"])
                if s["ttft_p95_ms"] is not None:
                    ttft.add_metric([n, side], s["ttft_p95_ms"] / 1000)
                if s["tpot_p50_ms"] is not None:
                    tpot.add_metric([n, side], s["tpot_p50_ms"] / 1000)
        yield from (err, ttft, tpot)
        w = GaugeMetricFamily("tandem_rollout_weight", "Candidate weight, percent.",
                              labels=["rollout", "route", "candidate"])
        st = GaugeMetricFamily("tandem_rollout_state", "The rollout's state (1).", labels=["rollout", "state"])
        for r in self.rollouts:
            if r["state"] in HOLDING_STATES:   # an ended rollout's last weight is no longer the route's
                w.add_metric([r["name"], r["route"], r["candidate"]], r["weight"])
            st.add_metric([r["name"], r["state"]], 1)
        yield from (w, st)
