"""``slo: {ttft_ms: ..., tpot_ms: ...}``: the cheapest target predicted to meet a TTFT objective (and, when set, a
time-per-output-token one), else the fastest.

Each target's predicted TTFT comes in the live signals (``Signals.ttft``, by backend name): for the co-located
engine, its prediction for this very request at admission (``engine/core/ttft.py``); for an upstream, the gateway's
rolling estimate from its own attempts (``gateway/backends/latency.py``). A target meets the SLO when its
``TTFTEstimate.checked`` does: an upstream's p90, the engine's prediction plus the p90 of its own recent error
(a prediction is a median: one just under the SLO would miss it about half of the time). A target with no
estimate yet is
assumed to meet the SLO (it gets traffic, hence an estimate), and one failing half of its recent calls or more
is assumed not to. With ``tpot_ms`` a target must also be predicted to decode that fast (``TTFTEstimate.tpot``: the
engine's step cost at the batch it would decode in; an upstream's rolling measurement); a target without a TPOT
figure is assumed to meet it. The cost of the request on a target is its prompt at the target's input price plus
``max_tokens`` (else ``EXPECTED_OUTPUT_TOKENS``) at its output price.

A hand-over (``Handover``): when the cheapest target meeting the SLO is an engine that can take back a request it
has not started (the co-located one: its estimate has a ``scale``) and a dearer target meets the SLO too, the
request goes to the engine with a checkpoint: at ``after_s`` from admission (the SLO less the other target's
checked TTFT, less ``HANDOVER_MARGIN_S``) the engine re-predicts its first token from its place in the queue, and
a request predicted late is withdrawn, nothing of it computed, and sent on to the next target
(``gateway/backends/local.py``). A prediction at admission is a median plus a margin; the re-prediction has
less left to predict, so a request predicted in time at admission and then delayed still meets the SLO elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

# Completion tokens a request without max_tokens is priced for: only the ranking between targets uses it.
EXPECTED_OUTPUT_TOKENS = 256
# An upstream failing this share of its recent calls or more is not counted on to meet an SLO.
MAX_ERROR_RATE = 0.5
# Seconds kept between a hand-over's checkpoint and the latest the next target can start to meet the SLO: the
# engine answers the checkpoint between two of its steps (a step at the peak of a spill run takes up to ~0.2 s
# on a 2-core CPU) and the next call is set up. Measured (spill runs, 2026-12-03): with 0.15 s, 3-4 of each run's
# 9-13 requests handed over missed the SLO (2.50-2.63 s); with 0.35 s, 1 of 43 in three runs.
HANDOVER_MARGIN_S = 0.35


@dataclass(frozen=True)
class Slo:
    """A service level objective: time to first token and (optionally) time per output token, milliseconds."""

    ttft_ms: float
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.ttft_ms > 0:
            raise ValueError(f"slo.ttft_ms must be > 0, got {self.ttft_ms!r}")
        if self.tpot_ms is not None and not self.tpot_ms > 0:
            raise ValueError(f"slo.tpot_ms must be > 0, got {self.tpot_ms!r}")


@dataclass(frozen=True)
class TTFTEstimate:
    """A backend's predicted TTFT for this request (``seconds``; None: no estimate yet), what it is based on
    (``basis``, for explanations), the share of its recent calls that failed (``error_rate``, 0..1) and the
    figure the SLO is checked against (``high``, seconds: the prediction plus its own observed error's 90th
    percentile, so that a prediction just under the SLO does not miss it half of the time; None: ``seconds``,
    already a high percentile for an upstream) and its predicted time per output token (``tpot``, seconds; None:
    no figure)."""

    seconds: float | None
    basis: str = ""
    error_rate: float = 0.0
    high: float | None = None
    tpot: float | None = None
    scale: float | None = None   # an engine that can withdraw a queued request: its own prediction -> ``checked``

    @property
    def checked(self) -> float | None:
        """Seconds compared with the SLO."""
        return self.seconds if self.high is None else self.high


@dataclass(frozen=True)
class Handover:
    """A checkpoint on a request sent to an engine that can withdraw it (see the module docstring): at
    ``after_s`` seconds from admission, withdraw it if its first token, re-predicted x ``scale``, would come after
    ``by_s`` (the SLO); the attempt loop then goes on to ``to`` (a target id), predicted to answer in time."""

    after_s: float
    by_s: float
    scale: float
    to: str

    def describe(self) -> str:
        return f"hand over to {self.to} at {self.after_s:.2f} s if then predicted late"


def handover(good: list, slo: Slo, est: dict[str, TTFTEstimate]) -> Handover | None:
    """The ``Handover`` of a request whose targets predicted to meet ``slo`` are ``good`` (in rank order), or None
    when the first cannot withdraw a request, no other meets the SLO, the next one has no estimate yet (how late
    a hand-over may come is not known) or its checked TTFT leaves no time for a checkpoint."""
    if len(good) < 2 or est[good[0].id].scale is None or est[good[1].id].checked is None:
        return None
    budget_s = slo.ttft_ms / 1000.0
    after = budget_s - est[good[1].id].checked - HANDOVER_MARGIN_S
    return Handover(after, budget_s, est[good[0].id].scale, good[1].id) if after > 0 else None


def request_cost(target, prompt_tokens: int | None, max_tokens: int | None, cached: bool = False) -> float:
    """USD of a request on ``target`` (a ``policies.Target``; prices in USD per million tokens); ``cached``: its
    prompt priced at the target's cached-input price (the conversation's home, whose prompt cache holds it)."""
    out = max_tokens if max_tokens is not None else EXPECTED_OUTPUT_TOKENS
    price = target.cached_input_price if cached and target.cached_input_price is not None else target.input_price
    return ((prompt_tokens or 0) * price + out * target.output_price) / 1e6


def rank(live: list, slo: Slo, estimates: dict[str, TTFTEstimate], prompt_tokens: int | None,
         max_tokens: int | None, home: str = "") -> tuple[list, str, dict[str, float], Handover | None]:
    """``live`` targets in the order to try them for ``slo``: those predicted to meet it by cost (then
    predicted TTFT, then route order), then the others by predicted TTFT. ``home``: the id of the target whose
    prompt cache holds this conversation (a sticky route), priced at its cached-input price. Returns (ranked, the
    explanation quoting each target's prediction and cost, target id -> USD, the first target's ``Handover`` or
    None)."""
    budget_s = slo.ttft_ms / 1000.0
    cost = {t.id: request_cost(t, prompt_tokens, max_tokens, t.id == home) for t in live}
    est = {t.id: estimates.get(t.backend, TTFTEstimate(None)) for t in live}

    tpot_s = slo.tpot_ms / 1000.0 if slo.tpot_ms is not None else None

    def fast_enough(e: TTFTEstimate) -> bool:
        return tpot_s is None or e.tpot is None or e.tpot <= tpot_s

    def meets(t) -> bool:
        e = est[t.id]
        return e.error_rate < MAX_ERROR_RATE and (e.checked is None or e.checked <= budget_s) and fast_enough(e)

    def predicted(t) -> float:
        s = est[t.id].seconds
        return 0.0 if s is None else s

    order = {t.id: i for i, t in enumerate(live)}
    good = sorted((t for t in live if meets(t)), key=lambda t: (cost[t.id], predicted(t), order[t.id]))
    bad = sorted((t for t in live if not meets(t)), key=lambda t: (predicted(t), cost[t.id], order[t.id]))
    parts = []
    for t in good + bad:
        e = est[t.id]
        said = "no estimate yet" if e.seconds is None else f"predicted {e.seconds:.2f} s"
        if e.high is not None and e.seconds is not None:
            said += f" (p90 {e.high:.2f} s)"
        cmp = "" if e.checked is None else (" <= " if e.checked <= budget_s else " > ") + f"SLO {budget_s:g} s"
        if tpot_s is not None and e.tpot is not None:
            cmp += f", TPOT {1000 * e.tpot:.0f} ms" + (" <= " if fast_enough(e) else " > ") + f"{slo.tpot_ms:g} ms"
        err = f", {100 * e.error_rate:.0f} % errors" if e.error_rate else ""
        basis = f" [{e.basis}]" if e.basis else ""
        warm = " (prompt cache home)" if t.id == home else ""
        parts.append(f"{t.id} {said}{cmp} at {cost[t.id]:.5f} USD{warm}{err}{basis}")
    tpot_head = f", tpot {slo.tpot_ms:g} ms" if slo.tpot_ms is not None else ""
    hand = handover(good, slo, est)
    if good:
        head = f"SLO ttft {slo.ttft_ms:g} ms{tpot_head}: cheapest predicted to meet it: {good[0].id}"
        head += f" ({hand.describe()})" if hand is not None else ""
    else:
        head = f"SLO ttft {slo.ttft_ms:g} ms{tpot_head}: none predicted to meet it; fastest: {bad[0].id}"
    return good + bad, head + "; " + "; ".join(parts), cost, hand
