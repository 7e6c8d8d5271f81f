"""The engine's step costs, measured online from the steps it runs (``TTFTCalibration``): what a TTFT
prediction (``engine/core/ttft_sim.py``) charges each step it simulates up to a request's first token.

The form: a step of ``rows`` decode rows and prefill chunks (new tokens q_i), its rows (decode rows and chunks
alike) attending over p (query, key) pairs in all (``ttft.quad_of``), takes

    T = s(t) x (a + b rows + c sum q_i + d p + e #chunks)   seconds,

the linear-plus-quadratic prefill latency of DistServe's model (Zhong et al., OSDI 2024, sec. 3 and app. A: the
linear layers' work grows with the tokens, attention's with tokens x context) extended to a chunked-prefill step
as Sarathi-Serve's chunks see it (Agrawal et al., OSDI 2024: a chunk attends over every token before it), and
Vidur's per-batch-shape runtime (Agrawal et al., MLSys 2024) fitted online instead of profiled. The shape
(a..e) is a least-squares fit over the last few hundred steps; s(t), the box's speed, is the ratio of the recent
steps' measured seconds to the shape's, over seconds of wall time: on a shared host other processes change every
cost at once, within seconds, while the shape holds.

Given the model's attention price (``pairs_per_token``: pairs that cost a token's linear layers,
``engine/core/step_cost.py``), d is tied to c (d = c / pairs_per_token): a prefill step's time is fitted on its
token-equivalents and its chunks. Fitted apart, c and d swung against each other (a long prompt's chunks carry
tokens and pairs together, so a few slow steps on a shared host moved cost from one to the other): within one
benchmark run the prefill rate ranged 197-4,881 tok/s and the pair's price 0.8-2.2 us, and the predictions
followed (``loadtests/bench/ttft_accuracy.py``: p90 error 80-116 %)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Seconds over which a step's weight in the speed s(t) falls by a factor e (wall time, idle time included): the
# box's speed changes within seconds when other processes take its cores, and a prefill rate remembered over
# twenty prefill steps (an EWMA per step) took ~25 s to recover from a load spike on an SLO route that sends the
# engine about one request a second (its requests predicted 40-60 % off meanwhile).
CALIBRATION_TAU_S = 3.0
# Steps over which a step's weight in the shape fit falls by a factor e. Forgotten by wall time as the speed is,
# the shape kept one or two steps where a step takes seconds (a loaded 2-core host: 1-20 s a prefill step), and
# each slow step moved whichever cost its features excited (a long context's attention: predictions 1.5-2x).
SHAPE_MEMORY_STEPS = 200.0
# Units the prefill fit scales its features by (tokens; tokens x tokens) so that they are of like size.
_T_UNIT, _Q_UNIT = 100.0, 10_000.0
# Weight of the current estimate of the decode line against the steps measured (in steps): keeps what recent
# steps do not separate (the fixed part of a step from its per-row part when every step ran one row) where it was.
_PRIOR_WEIGHT = 0.3


def prefill_seconds(costs, tokens: float, quad: float = 0.0, chunks: float = 0.0) -> float:
    """Seconds a step spends on ``tokens`` prefill tokens in ``chunks`` chunks of ``quad_of`` ``quad``, beyond its
    decode: tokens / ``prefill_tok_s`` + quad x ``quad_s`` + chunks x ``chunk_s`` of ``costs`` (a
    ``TTFTCalibration``, or the ``TTFTState`` that publishes its costs)."""
    return tokens / costs.prefill_tok_s + quad * costs.quad_s + chunks * costs.chunk_s


class _LeastSquares:
    """A least-squares fit of ``y ~ sum c_i x_i`` kept as its weighted sums (of x_i x_j and of x_i y), solved with
    a ridge toward a prior and its coefficients kept valid as costs (not negative)."""

    def __init__(self, n: int) -> None:
        self.xx = [[0.0] * n for _ in range(n)]
        self.xy = [0.0] * n

    def decay(self, factor: float) -> None:
        """Multiply every sum by ``factor`` (forgetting: an older sample weighs less)."""
        self.xy = [v * factor for v in self.xy]
        self.xx = [[v * factor for v in row] for row in self.xx]

    def add(self, x: tuple[float, ...], y: float, weight: float = 1.0) -> None:
        """Fold in one sample ``(x, y)`` of ``weight``."""
        for i, xi in enumerate(x):
            self.xy[i] += weight * xi * y
            for j, xj in enumerate(x):
                self.xx[i][j] += weight * xi * xj

    def fit(self, w: float, prior: tuple[float, ...]) -> list[float]:
        """Coefficients solving ``(xx + w I) c = xy + w prior`` (a ridge of weight ``w`` toward ``prior``), costs
        kept valid: a negative coefficient other than the first is held at 0 and the others refitted (the most
        negative first); a first one <= 0 leaves the first alone (e.g. the prefill rate, every other cost 0)."""
        active = list(range(len(self.xy)))
        while True:
            a = [[self.xx[i][j] + (w if i == j else 0.0) for j in active] for i in active]
            b = [self.xy[i] + w * prior[i] for i in active]
            sol = dict(zip(active, _solve(a, b)))
            if sol[0] <= 0:
                return [b[0] / a[0][0]] + [0.0] * (len(self.xy) - 1)
            worst = min(active[1:], key=lambda i: sol[i], default=None)
            if worst is None or sol[worst] >= 0:
                return [sol.get(i, 0.0) for i in range(len(self.xy))]
            active.remove(worst)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (a small symmetric positive definite system: Gaussian elimination, no pivoting needed)."""
    n = len(b)
    a = [row[:] + [b[i]] for i, row in enumerate(a)]
    for k in range(n):
        for i in range(k + 1, n):
            f = a[i][k] / a[k][k]
            for j in range(k, n + 1):
                a[i][j] -= f * a[k][j]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


@dataclass
class TTFTCalibration:
    """Step costs measured online: ``cost`` = speed x shape (the module's form). The published costs
    (``fixed_s``, ``row_s``, ``prefill_tok_s``, ``quad_s``, ``chunk_s``, ``step_s``) are the shape's times the
    speed; constructed with them, they are the shape the first steps refine.

    The shape: a decode-only step of n rows costs ``fixed + n x row`` plus its rows' attention pairs x c2: a
    least-squares line through the decode steps, less that attention; a step with prefill costs that for its
    decode rows plus its prefill time, fitted as tokens x c1 + ``quad_of`` x c2 + chunks x c3 (c1 = 1 /
    ``prefill_tok_s``; with ``pairs_per_token`` set, c2 = c1 / ``pairs_per_token`` and (tokens + pairs /
    ``pairs_per_token``) x c1 + chunks x c3 is fitted). Each sum weighs a step by exp(-steps since /
    ``SHAPE_MEMORY_STEPS``) (recursive least squares with exponential forgetting, Haykin, *Adaptive Filter
    Theory*, ch. 10), with a small ridge toward the current estimate (steps that all ran one row do not separate
    the fixed part from the per-row part; their sum stays right). The speed: the measured seconds of the steps
    over the shape's, both summed with weights exp(-age / ``CALIBRATION_TAU_S``) in wall time (a ratio of sums:
    long steps, which average the host's speed over their length, weigh most).

    Why two fits: in a deep queue every step is full (prefill tokens = budget - rows), the three costs are
    collinear there and one fit of all of them wandered (one-row steps predicted at 0 ms, eight-row ones at
    1.5 s). Why a chunk term: each chunk (one request's prefill in a step) costs ``chunk_s`` whatever its length;
    measured (steps of three spill load-test runs on an AVX512-BF16 host, least squares over each run's ~1,900
    steps): 8.7-9.9 ms a chunk and 0.21-0.23 ms a token, where a fit without it gave 0.27-0.29 ms a token and
    left steps of 1-80 prefill tokens 10-12 % longer than it predicted. Starts from a guess (``step_s`` seconds
    for a one-row decode step, ``prefill_tok_s`` tokens/s) that the first steps replace. ``pairs_per_token``: the
    model's attention pairs per token-equivalent (``step_cost.device_pairs_per_token``), or 0: c2 fitted apart."""

    step_s: float = 0.05
    prefill_tok_s: float = 2000.0
    steps: int = 0
    fixed_s: float = 0.0
    row_s: float = 0.0
    quad_s: float = 0.0
    chunk_s: float = 0.0
    speed: float = 1.0
    pairs_per_token: float = 0.0
    _shape: list[float] = field(default_factory=list, repr=False)   # fixed, row, s/token, quad, chunk (speed 1)
    _line: _LeastSquares = field(default_factory=lambda: _LeastSquares(2), repr=False)    # decode steps: (1, rows)
    # prefill steps: (tokens, quad, chunks), scaled
    _prefill: _LeastSquares = field(default_factory=lambda: _LeastSquares(3), repr=False)
    _fit_n: int = field(default=0, repr=False)                          # prefill steps observed
    # the speed's sums, each step weighted by its age: seconds, and features (1, rows, tokens, quad, chunks)
    _measured: float = field(default=0.0, repr=False)
    _features: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)
    _at: float | None = field(default=None, repr=False)   # clock of the last observation, seconds
    _clock: float = field(default=0.0, repr=False)        # steps' seconds summed (when no clock is given)

    def __post_init__(self) -> None:
        if not self.fixed_s and not self.row_s:   # the guess: a one-row decode step, a fifth of it per row
            self.fixed_s, self.row_s = 0.8 * self.step_s, 0.2 * self.step_s
        if self.pairs_per_token:
            self.quad_s = 1.0 / (self.prefill_tok_s * self.pairs_per_token)
            self._prefill = _LeastSquares(2)
        self._shape = [self.fixed_s, self.row_s, 1.0 / self.prefill_tok_s, self.quad_s, self.chunk_s]
        self._publish()

    def cost(self, decode_rows: float, prefill_tokens: float = 0.0, quad: float = 0.0, chunks: float = 0.0) -> float:
        """Predicted seconds of a step computing ``decode_rows`` decode rows and ``prefill_tokens`` prefill
        tokens in ``chunks`` chunks of ``quad_of`` ``quad``."""
        return self.fixed_s + self.row_s * decode_rows + prefill_seconds(self, prefill_tokens, quad, chunks)

    def _shape_cost(self, decode_rows: float, prefill_tokens: float, quad: float, chunks: float,
                    steps: float = 1.0) -> float:
        a, b, c, d, e = self._shape
        return a * steps + b * decode_rows + c * prefill_tokens + d * quad + e * chunks

    def observe(self, seconds: float, prefill_tokens: int, decode_rows: int, at: float | None = None,
                quad: float = 0.0, chunks: int = 0) -> None:
        """Fold in one step: ``seconds`` of wall time, ``prefill_tokens`` prefill tokens and ``decode_rows``
        decode rows computed, ending at ``at`` (seconds on any monotonic clock; None: right after the previous
        step); ``quad``: its prefill chunks' ``quad_of``; ``chunks``: how many (0: not counted, the chunk cost is
        left where it is). ``step_s`` then is the cost of a one-row decode step."""
        if seconds <= 0 or (prefill_tokens == 0 and decode_rows == 0):
            return
        self._clock += seconds
        at = self._clock if at is None else at
        age = 1.0 if self._at is None else math.exp(-max(at - self._at, 0.0) / CALIBRATION_TAU_S)
        self._at = at
        forget = math.exp(-1.0 / SHAPE_MEMORY_STEPS)
        self._line.decay(forget)
        self._prefill.decay(forget)
        fixed, row, per_token, quad_s, chunk_s = self._shape
        shaped = seconds / self.speed   # the step at the speed of the steps before it: the shape's own units
        if prefill_tokens == 0:   # the decode rows' attention over their contexts is priced apart
            self._line.add((1.0, float(decode_rows)), max(shaped - quad_s * quad, 0.2 * shaped))
            w = _PRIOR_WEIGHT if self.steps else 1e-3   # the first step replaces the guess along its own direction
            fixed, row = self._line.fit(w, (fixed, row))
            self._shape[:2] = max(fixed, 1e-4), row
        else:
            # A step with prefill pays its decode cost too; a fifth of the step is a floor on its prefill time so
            # that one noisy decode measurement cannot make the prefill rate infinite.
            # Its prefill time: c1 x tokens + c2 x quad + c3 x chunks, fitted (features scaled to like sizes) with
            # a ridge toward the current estimate; a negative cost is dropped from the fit (``_LeastSquares.fit``).
            y = max(shaped - fixed - row * decode_rows, 0.2 * shaped)
            guessed = per_token * prefill_tokens + quad_s * quad + chunk_s * chunks
            # Relative least squares: each step weighs the inverse square of its prefill time as the shape
            # guesses it (no more than a decode step's), so a 40-token prompt's step counts as much as a chunk
            # deep in a long prompt that takes a hundred times as long (``TTFTCalibration``: why).
            w = min((fixed + row) / max(guessed, 1e-9), 1.0) ** 2
            if self.pairs_per_token:   # tokens and pairs priced by one coefficient: token-equivalents
                self._prefill.add(((prefill_tokens + quad / self.pairs_per_token) / _T_UNIT, float(chunks)), y, w)
            else:
                self._prefill.add((prefill_tokens / _T_UNIT, quad / _Q_UNIT, float(chunks)), y, w)
            if self._fit_n == 0 and guessed > 0:
                # The first prefill step scales the guess to its time: fitted alone, one step's three features
                # put its whole time on the largest (a long context's quad: 53 us a token x context, ten times
                # the steps that followed, in the first seconds of a bench run).
                self._shape[2:] = [v * y / guessed for v in (per_token, quad_s, chunk_s)]
            elif self.pairs_per_token:
                c1, c3 = self._prefill.fit(_PRIOR_WEIGHT, (_T_UNIT * per_token, chunk_s))
                c1 = max(c1, 1e-9) / _T_UNIT
                self._shape[2:] = c1, c1 / self.pairs_per_token, c3
            else:
                c1, c2, c3 = self._prefill.fit(_PRIOR_WEIGHT, (_T_UNIT * per_token, quad_s * _Q_UNIT, chunk_s))
                self._shape[2:] = max(c1, 1e-9) / _T_UNIT, c2 / _Q_UNIT, c3
            self._fit_n += 1
        # The speed: the recent steps' seconds over the shape's as it is now for the same steps (the cost is
        # linear in the features: their weighted sums give it). Against the shape of each step's own time, a
        # shape still remembering slow steps made the speed of the fast ones that followed too low.
        self._measured = self._measured * age + seconds
        x = (1.0, float(decode_rows), float(prefill_tokens), quad, float(chunks))
        self._features = [f * age + xi for f, xi in zip(self._features, x)]
        f = self._features
        self.speed = self._measured / self._shape_cost(f[1], f[2], f[3], f[4], steps=f[0])
        self.steps += 1
        self._publish()

    def _publish(self) -> None:
        fixed, row, per_token, quad_s, chunk_s = (v * self.speed for v in self._shape)
        self.fixed_s, self.row_s, self.prefill_tok_s, self.quad_s, self.chunk_s = (
            fixed, row, 1.0 / per_token, quad_s, chunk_s)
        self.step_s = fixed + row
