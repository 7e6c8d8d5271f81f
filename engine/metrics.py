"""Prometheus metrics of the engine, with vLLM's names (so vLLM dashboards work).

Gauges and the scheduler's cumulative counters are read from
``AsyncEngine.get_stats()`` at scrape time; per-request counters and
histograms are fed by an output listener that runs where outputs are
processed (the engine's front end), and embedding calls by a pooling listener (``record_pooled``).
Everything lives in the ``CollectorRegistry`` given to ``EngineMetrics``
(one per app; no global registry).

Names (all with label ``model_name``), as in vLLM ``v1/metrics/loggers.py``:
``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (0..1), ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (tokens), ``vllm:num_preemptions_total``,
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total`` (+ ``finished_reason``),
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``,
``vllm:request_prefill_time_seconds``, ``vllm:request_decode_time_seconds``,
``vllm:request_inference_time_seconds``, ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``
(one sample per choice, as vLLM v1's child requests), ``vllm:request_max_num_generation_tokens`` (per request: its
longest choice's),
``vllm:request_params_n``, ``vllm:request_params_max_tokens``, ``vllm:request_prefill_kv_computed_tokens``
(prompt tokens not read from the prefix cache), ``vllm:request_time_per_output_token_seconds`` (a choice's decode
time over its tokens after its first), ``vllm:iteration_tokens_total`` (tokens per engine step, from the core's
``EngineStats``),
``vllm:cache_config_info``, ``vllm:lora_requests_info`` (the inference extension's model-server protocol reads
it; no adapters here); with speculative decoding on, ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` and
``vllm:spec_decode_num_accepted_tokens_per_pos`` (+ ``position``), all with Tandem's label ``method`` (the
proposer), and Tandem's histogram ``tandem_spec_decode_accepted_tokens_per_draft`` (verified drafts by accepted
tokens: buckets ``le`` 0..k); Tandem's ``tandem_structured_output_invalid_total`` (finished structured answers
that broke their schema, ``engine/serving/answer_check.py``).
"""

from __future__ import annotations

import itertools
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.core.step_work import ITERATION_TOKEN_BUCKETS
from engine.outputs import RequestOutput

# vLLM's bucket boundaries, seconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# vLLM's ``request_params_n`` buckets
N_BUCKETS = [1, 2, 5, 10, 20]
# vLLM's ``request_time_per_output_token_seconds`` buckets, seconds
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's bucket boundaries for a token count (``build_1_2_5_buckets``): 1, 2, 5, 10, 20, 50, ... up to
    ``max_model_len``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


def _spec_decode_families(stats, model_name: str):
    """vLLM's ``spec_decode`` counters and Tandem's acceptance histogram, labelled with the proposer
    (``method``), from an ``EngineStats`` of an engine that speculates."""
    labels = [model_name, stats.spec_method]
    for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec_num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", stats.spec_num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", stats.spec_num_accepted_tokens)):
        fam = CounterMetricFamily(name, doc, labels=["model_name", "method"])
        fam.add_metric(labels, float(value))
        yield fam
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=["model_name", "method", "position"])
    for pos, n in enumerate(stats.spec_num_accepted_tokens_per_pos):
        per_pos.add_metric(labels + [str(pos)], float(n))
    yield per_pos
    hist = HistogramMetricFamily("tandem_spec_decode_accepted_tokens_per_draft",
                                 "Verified drafts by their number of accepted tokens.", labels=["model_name", "method"])
    buckets, total = [], 0
    for accepted, n in enumerate(stats.spec_accepted_per_draft):
        total += n
        buckets.append((str(accepted), float(total)))
    buckets.append(("+Inf", float(total)))
    hist.add_metric(labels, buckets, sum_value=float(stats.spec_num_accepted_tokens))
    yield hist


def _iteration_tokens_family(stats, model_name: str) -> HistogramMetricFamily:
    """vLLM's ``vllm:iteration_tokens_total`` (tokens per engine step) from the core's cumulative bucket counts
    (``EngineStats.iteration_tokens``; zeros before the engine started)."""
    counts = list(stats.iteration_tokens) if stats is not None and stats.iteration_tokens else \
        [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    fam = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                labels=["model_name"])
    bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
    fam.add_metric([model_name], list(zip(bounds, map(float, itertools.accumulate(counts)))),
                   sum_value=float(stats.iteration_tokens_sum if stats is not None else 0))
    return fam


class _LiveCollector:
    """Scrape-time gauges and cumulative scheduler counters from ``engine.get_stats()``."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []  # collected lazily: the engine may not be started at registration

    def collect(self):
        labels = [self.model_name]
        try:
            stats = self.engine.get_stats()
        except Exception:  # noqa: BLE001 - not started yet
            stats = None
        families = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
             "num_running"),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             "num_waiting"),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             "kv_cache_usage"),
            (CounterMetricFamily, "vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
            (CounterMetricFamily, "vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
            (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
        ]
        for cls, name, doc, attr in families:
            fam = cls(name, doc, labels=["model_name"])
            fam.add_metric(labels, float(getattr(stats, attr)) if stats is not None else 0.0)
            yield fam
        invalid = CounterMetricFamily("tandem_structured_output_invalid",
                                      "Finished structured answers that broke their schema (returned as length).",
                                      labels=["model_name"])
        invalid.add_metric(labels, float(getattr(self.engine, "structured_output_invalid", 0)))
        yield invalid
        if stats is not None and getattr(stats, "spec_method", ""):
            yield from _spec_decode_families(stats, self.model_name)
        yield _iteration_tokens_family(stats, self.model_name)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                 labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching",
                                         "cache_dtype", "swap_space_bytes"])
        args = self.engine.args
        info.add_metric([self.model_name, str(args.block_size), str(getattr(self.engine, "num_blocks", 0)),
                         str(args.enable_prefix_caching), str(args.dtype),
                         str(int(args.swap_space * 2**30))], 1.0)
        yield info
        # The inference extension's LoRA signal (its model-server protocol): no adapters are served, so both lists
        # are empty and max_lora is 0; the value is the time of the reading, as vLLM's.
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        lora.add_metric([self.model_name, "0", "", ""], time.time())
        yield lora


# vLLM v1's FinishReason values (vllm/v1/engine/__init__.py), whose request_success series exist from the start
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


class EngineMetrics:
    """vLLM-named metrics of one ``AsyncEngine``, in ``registry``.

    Args:
        registry: this app's registry (``generate_latest(registry)`` serves it).
        engine: the ``AsyncEngine`` (started or not).
        model_name: value of the ``model_name`` label.

    ``record(outputs, now)`` must be registered as the engine's output
    listener (``attach()`` does it); it runs in the thread that processes outputs.
    """

    def __init__(self, registry: CollectorRegistry, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._live = _LiveCollector(engine, model_name)
        registry.register(self._live)
        label = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", label,
                                     registry=registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         label, registry=registry).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       ["model_name", "finished_reason"], registry=registry)
        for reason in FINISHED_REASONS:   # at 0 from the start, as vLLM's: a panel on one reason shows 0, not no data
            self.request_success.labels(model_name, reason)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              label, buckets=TTFT_BUCKETS, registry=registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             label, buckets=ITL_BUCKETS, registry=registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             label, buckets=REQUEST_LATENCY_BUCKETS, registry=registry).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", label,
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=registry).labels(model_name)
        tokens = token_buckets(int(getattr(engine, "max_model_len", 0) or 8192))
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               label, buckets=tokens, registry=registry).labels(model_name)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", label, buckets=tokens,
            registry=registry).labels(model_name)
        self.request_max_num_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            label, buckets=tokens, registry=registry).labels(model_name)
        self.request_params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", label,
                                          buckets=N_BUCKETS, registry=registry).labels(model_name)
        self.request_params_max_tokens = Histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", label,
            buckets=tokens, registry=registry).labels(model_name)
        self.request_prefill_kv_computed_tokens = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", label, buckets=tokens,
            registry=registry).labels(model_name)
        self.request_tpot = Histogram(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            label, buckets=TPOT_BUCKETS, registry=registry).labels(model_name)
        self.phase = {name: Histogram(f"vllm:request_{name}_time_seconds", help_, label,
                                      buckets=REQUEST_LATENCY_BUCKETS, registry=registry).labels(model_name)
                      for name, help_ in (("prefill", "Histogram of time spent in PREFILL phase for request."),
                                          ("decode", "Histogram of time spent in DECODE phase for request."),
                                          ("inference", "Histogram of time spent in RUNNING phase for request."))}
        # Listener state: requests that produced a token; request id -> {index: last token time}, and -> {index:
        # its tokens so far} (a finished request's last delta holds only the choices with news).
        self._first_seen: set[str] = set()
        self._last_token: dict[str, dict[int, float]] = {}
        self._generated: dict[str, dict[int, int]] = {}

    def attach(self) -> "EngineMetrics":
        """Register ``record`` as the engine's output listener, ``record_pooled`` as its pooling listener."""
        self.engine.add_output_listener(self.record)
        self.engine.add_pooling_listener(self.record_pooled)
        return self

    def follow(self, engine) -> None:
        """Count ``engine`` from now on in place of the one given (the same backend's next engine: its core
        died and was started again, or a reload started another): the scrape-time gauges read it and its outputs
        feed the counters and histograms, which go on from their totals (a registry takes each name once, so
        new ones cannot be registered; without this they stayed flat after a restart, an SRE's trial found)."""
        self.engine = self._live.engine = engine
        self.attach()

    def record(self, outputs: list[RequestOutput], now: float) -> None:
        """Update counters and histograms from one step's delta outputs
        (``now``: ``time.monotonic()`` seconds). Each choice of an n > 1 request counts as vLLM v1 counts its
        child requests: one sample per choice in ``request_success``, TTFT, queue time, e2e latency, the phases
        and the per-request token histograms; ``request_params_n`` and ``request_max_num_generation_tokens`` once
        per request (vLLM's ``ParentRequest``)."""
        for out in outputs:
            rid = out.request_id
            m = out.metrics
            has_tokens = any(c.token_ids for c in out.outputs)
            if has_tokens and rid not in self._first_seen:
                self._first_seen.add(rid)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if m is not None:
                    first = m.first_token_time or now
                    for _ in range(m.n_param):          # every choice's first token comes in this step
                        self.ttft.observe(max(first - m.arrival_time, 0.0))
                        if m.first_scheduled_time is not None:
                            self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            generated = self._generated.setdefault(rid, {})
            for c in out.outputs:
                if c.token_ids or c.num_generated_tokens:
                    generated[c.index] = c.num_generated_tokens
                if c.token_ids:
                    self.generation_tokens.inc(len(c.token_ids))
                    t = m.last_token_time if m is not None and m.last_token_time else now
                    last = self._last_token.setdefault(rid, {})
                    prev = last.get(c.index)
                    if prev is not None:
                        self.itl.observe(max(t - prev, 0.0) / len(c.token_ids))
                    last[c.index] = t
                if c.finish_reason is not None:
                    self.request_success.labels(self.model_name, c.finish_reason).inc()
                    if m is not None and rid in self._first_seen:
                        self._choice_finished(out, m, generated.get(c.index, 0),
                                              (m.finished_time if out.finished else None) or now)
            if out.finished:
                if m is not None and rid in self._first_seen:
                    self.request_params_n.observe(m.n_param)
                    self.request_max_num_generation_tokens.observe(max(generated.values(), default=0))
                self._first_seen.discard(rid)
                self._last_token.pop(rid, None)
                self._generated.pop(rid, None)

    def record_pooled(self, prompt_lens: list[int], arrival: float, now: float, reason: str = "stop") -> None:
        """One ended embedding call (``time.monotonic()`` seconds of the call and its end): each prompt of an
        answered one (``reason`` "stop") counts as vLLM v1 counts a finished pooling request (its
        ``OutputProcessor`` sends pooling outputs through the same stats as generation): its tokens in
        ``prompt_tokens`` and ``request_prompt_tokens``, one ``request_success`` (``finished_reason`` ``stop``), the
        call's time in ``e2e_request_latency``. A trial found embedding traffic missing from all four. Each prompt
        of a call its caller left (``reason`` "abort") is one ``request_success`` with ``finished_reason`` ``abort``,
        as vLLM counts an aborted request (a capacity trial found no trace of it)."""
        if reason != "stop":
            self.request_success.labels(self.model_name, reason).inc(len(prompt_lens))
            return
        for tokens in prompt_lens:
            self.prompt_tokens.inc(tokens)
            self.request_prompt_tokens.observe(tokens)
            self.request_success.labels(self.model_name, "stop").inc()
            self.e2e.observe(max(now - arrival, 0.0))

    def _choice_finished(self, out: RequestOutput, m, tokens: int, end: float) -> None:
        """The per-request histograms of one finished choice (vLLM's child request) of a request that produced
        tokens, ``tokens`` of them, ended at ``end``: vLLM's names and phases (prefill from first scheduled to
        first token, decode from first token to the end, inference both)."""
        self.e2e.observe(max(end - m.arrival_time, 0.0))
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_prefill_kv_computed_tokens.observe(max(len(out.prompt_token_ids) - out.num_cached_tokens, 0))
        self.request_generation_tokens.observe(tokens)
        if m.max_tokens_param is not None:
            self.request_params_max_tokens.observe(m.max_tokens_param)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            decode = max(end - m.first_token_time, 0.0)
            self.phase["prefill"].observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
            self.phase["decode"].observe(decode)
            self.phase["inference"].observe(max(end - m.first_scheduled_time, 0.0))
            self.request_tpot.observe(decode / (tokens - 1) if tokens > 1 else 0.0)
