"""Test helper: find the first op whose output for one request differs when
the request runs alone and when it runs inside a batch (or with a cached
prefix, chunked prefill, preemption...).

``probe(llm, prompts, target)`` runs ``prompts`` through ``llm`` while
recording, for every position of request ``target`` (its index in
``prompts``), the row each instrumented op produced: each decoder layer's
q/k/v projection, attention, o projection (+ residual), gate/up projection,
down projection (+ residual), the final norm and the logits. Two probes are
compared by :func:`first_difference`, which names the earliest position and,
within it, the first op (in forward order) whose rows are not bitwise equal.

Usage (a failing invariance test prints this)::

    alone = probe(LLM(dtype="bfloat16"), [prompt], target=0)
    batched = probe(LLM(dtype="bfloat16"), [other, prompt, more], target=1)
    print(first_difference(alone, batched))
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.sampling_params import SamplingParams

Record = dict[tuple[int, str], torch.Tensor]  # (position, op name) -> row


@contextmanager
def _instrument(llm, records: Record, target_id: str):
    """Patch the model runner and the model's layers to copy the rows of
    request ``target_id`` (its first sequence when n > 1) into ``records``."""
    targets = {target_id, f"{target_id}-0"}
    runner = llm.engine.model_runner
    model = runner.model
    state = {"rows": {}}  # row index in the step's flat batch -> position of the target request
    original_execute = runner.execute_model
    original_logits = model.compute_logits

    def execute_model(out):
        rows, start = {}, 0
        for s in out.scheduled:
            if s.request.request_id in targets:
                for j in range(s.num_new_tokens):
                    rows[start + j] = s.num_computed_tokens + j
            start += s.num_new_tokens
        state["rows"] = rows
        state["sample_rows"] = [i for i, s in enumerate(out.scheduled) if s.sample]
        state["target_sample"] = next((k for k, i in enumerate(state["sample_rows"])
                                       if out.scheduled[i].request.request_id in targets), None)
        state["target_pos"] = next((s.num_computed_tokens + s.num_new_tokens - 1 for s in out.scheduled
                                    if s.request.request_id in targets), None)
        return original_execute(out)

    def record(name: str, t: torch.Tensor) -> None:
        if t.dim() >= 1 and t.shape[0] >= len(state["rows"]):
            for row, pos in state["rows"].items():
                if row < t.shape[0]:
                    records.setdefault((pos, name), t[row].detach().clone())

    def wrap_layer(i, layer):
        proj, attn = dict(layer.proj), layer.backend.paged_attention  # the linear methods it chose

        def recorded(name, method):
            def call(x, residual=None):
                y = method(x, residual)
                record(f"layers.{i}.{name}", y)
                return y
            return call

        def paged_attention(*args, **kwargs):
            y = attn(*args, **kwargs)
            record(f"layers.{i}.attention", y)
            return y

        layer.proj.update({name: recorded(name, method) for name, method in proj.items()})
        layer.backend = _Backend(layer.backend, paged_attention)
        return layer, proj, layer.backend._inner

    def compute_logits(hidden):
        y = original_logits(hidden)
        k = state.get("target_sample")
        if k is not None and k < y.shape[0]:
            records.setdefault((state["target_pos"], "logits"), y[k].detach().clone())
        return y

    saved = [wrap_layer(i, layer) for i, layer in enumerate(model.layers)]
    runner.execute_model = execute_model
    model.compute_logits = compute_logits
    c_decoder = model.use_c_decoder
    model.use_c_decoder = False  # the per-operation path (the same bits) so that each op can be recorded
    try:
        yield
    finally:
        model.use_c_decoder = c_decoder
        runner.execute_model = original_execute
        model.compute_logits = original_logits
        for layer, proj, backend in saved:
            layer.proj.update(proj)
            layer.backend = backend


class _Backend:
    """An attention backend whose ``paged_attention`` is replaced (the rest delegates)."""

    def __init__(self, inner, paged_attention) -> None:
        self._inner = inner
        self.paged_attention = paged_attention

    def __getattr__(self, name):
        return getattr(self._inner, name)


def probe(llm, prompts: list, target: int, params: SamplingParams | None = None) -> Record:
    """Generate ``prompts`` on ``llm`` and return the recorded rows of
    ``prompts[target]``: {(position, op name): row tensor}."""
    params = params or SamplingParams(temperature=0.0, max_tokens=8)
    records: Record = {}
    first_id = next(llm._ids)  # the ids LLM.generate will hand out start right after this one
    with _instrument(llm, records, f"offline-{first_id + 1 + target}"):
        llm.generate(prompts, params)
    return records


def first_difference(a: Record, b: Record) -> str | None:
    """The earliest (position, op) whose rows differ bitwise, as a sentence; None if all shared rows are equal."""
    order = {}
    for pos, name in a:
        order.setdefault(name, len(order))
    for key in sorted(set(a) & set(b), key=lambda k: (k[0], order.get(k[1], 1 << 30))):
        x, y = a[key], b[key]
        if x.shape != y.shape or not torch.equal(x, y):
            diff = (x.float() - y.float()).abs().max().item() if x.shape == y.shape else float("nan")
            return f"position {key[0]}: {key[1]} differs (max abs diff {diff:.3g})"
    return None
