"""Output processing: the engine core's raw tokens -> ``RequestOutput`` deltas.

The core (``engine/core/engine_core.py``) reports, per choice and step, the
sampled token ids, raw logprobs and why the core finished it. Here, in the
front end, as in vLLM v1's ``OutputProcessor``
(vllm/v1/engine/output_processor.py): each choice's
``IncrementalDetokenizer`` turns tokens into text and applies the stop
strings; logprobs get their decoded tokens; the choices of one client
request are assembled into one ``RequestOutput`` with its metrics. A stop
string that ends a choice is returned in ``ProcessedOutputs.stops`` and the
caller tells the core (``EngineCore.finish_sequences``), which frees its
blocks. Output the core produced for a choice after that (the core in
another process may have run one more step) is dropped. The outputs are
deltas (what metrics count); ``as_asked`` gives each request's consumer
what its ``output_kind`` asks (vLLM's ``RequestOutputKind``).

Not thread-safe: one owner (``LLMEngine``, or ``AsyncEngine`` under its lock).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.core.core_messages import EngineCoreOutput
from engine.detokenizer import IncrementalDetokenizer, NoDetokenizer, detokenizer_for, fill_decoded_tokens
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _RequestState:
    """Front-end state of one client request."""

    prompt: str | None
    prompt_token_ids: list[int]
    detokenizers: list[IncrementalDetokenizer | NoDetokenizer]
    finished: list[bool]
    detokenize: bool = True   # False: token ids only (no text, logprobs without decoded tokens)
    prompt_logprobs: list | None = None
    first_token_time: float | None = None
    max_tokens: int | None = None


@dataclass
class ProcessedOutputs:
    """What one batch of core outputs became.

    Attributes:
        request_outputs: one delta ``RequestOutput`` per client request with news.
        stops: (request id, choice index, stop string) of the choices a stop
            string ended: hand them to ``EngineCore.finish_sequences``.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    stops: list[tuple[str, int, str]] = field(default_factory=list)


class OutputProcessor:
    """Detokenizes, applies stop strings and assembles outputs of live requests.

    Args:
        tokenizer: ``engine.tokenizer.Tokenizer`` (or anything with ``decode``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._kinds: dict[str, RequestOutputKind] = {}   # the live requests whose consumers want no deltas
        self._so_far: dict[str, RequestOutput] = {}      # their outputs so far, merged

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, resume: dict[int, list[int]] | None = None) -> None:
        """Start tracking a request the core accepted (or is about to). ``resume``: a continuation (choice index
        -> tokens generated before, see ``EngineCore.add_request``): each choice's detokenizer first reads its
        tokens (their text is not emitted again; stop strings and held-back text carry over), and the choices
        it does not name count as finished.

        Raises:
            ValueError: ``request_id`` is already live.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        detokenizers = [detokenizer_for(self.tokenizer, prompt_token_ids, params) for _ in range(params.n)]
        finished = [False] * params.n
        for index, done in (resume or {}).items():
            detokenizers[index].update(done)
        if resume is not None:
            finished = [i not in resume for i in range(params.n)]
        if params.output_kind != RequestOutputKind.DELTA:
            self._kinds[request_id] = params.output_kind
        self._requests[request_id] = _RequestState(
            prompt=prompt, prompt_token_ids=prompt_token_ids, detokenizers=detokenizers, finished=finished,
            detokenize=params.detokenize, max_tokens=params.max_tokens)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        """Live (unfinished) requests."""
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def awaits_first_token(self, request_id: str) -> bool:
        """``request_id`` is live and none of its outputs has come yet (the core may still hold it waiting)."""
        state = self._requests.get(request_id)
        return state is not None and state.first_token_time is None

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (the core refused or failed it)."""
        self._requests.pop(request_id, None)
        self._kinds.pop(request_id, None)
        self._so_far.pop(request_id, None)

    def fail_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request the engine failed (its core died, a step raised): its final output with
        ``finish_reason="error"`` for every unfinished choice, for the metrics (vLLM's ``FinishReason.ERROR``), or
        None when it was not live. Its stream gets the error itself."""
        out = self.abort_request(request_id)
        self.forget(request_id)
        if out is not None:
            for c in out.outputs:
                c.finish_reason = "error"
        return out

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request; its final output with ``finish_reason="abort"``
        for every unfinished choice (None when it was not live): its prompt, prompt ids and prompt logprobs as
        the earlier outputs had them, no metrics (a CUMULATIVE or FINAL_ONLY consumer keeps the last ones)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        return RequestOutput(
            request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids, finished=True,
            prompt_logprobs=state.prompt_logprobs,
            outputs=[CompletionOutput(index=i, finish_reason="abort")
                     for i, done in enumerate(state.finished) if not done])

    def as_asked(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The delta outputs of ``process_outputs`` or ``abort_request`` (in order) as each request's
        ``output_kind`` asks: DELTA ones as they are; CUMULATIVE ones with each choice of the delta whole so far
        (a copy: later outputs do not change it); FINAL_ONLY ones only once the request finished, with every
        choice whole."""
        if not self._kinds:             # every live request reads deltas (the default): nothing to shape
            return outputs
        asked = []
        for delta in outputs:
            kind = self._kinds.get(delta.request_id)
            if kind is None:
                asked.append(delta)
                continue
            so_far = merge_delta(self._so_far, delta)
            if delta.finished:
                del self._kinds[delta.request_id], self._so_far[delta.request_id]
            if kind == RequestOutputKind.CUMULATIVE:
                asked.append(_copy_of_choices(so_far, {c.index for c in delta.outputs}))
            elif delta.finished:
                asked.append(so_far)
        return asked

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float) -> ProcessedOutputs:
        """Turn one step's core outputs into delta ``RequestOutput``s: one per request, or for a call of several
        decode steps one per request and step (a choice's news again starts the next step's deltas).

        Args:
            outputs: the core's news of one step (of several steps: in step order).
            now: ``time.monotonic()`` of that step (the outputs' last token time).
        """
        result = ProcessedOutputs()
        deltas: dict[str, list[CompletionOutput]] = {}
        last: dict[str, EngineCoreOutput] = {}
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None or state.finished[out.index]:
                continue  # aborted, or ended by a stop string while the core ran one more step
            if any(c.index == out.index for c in deltas.get(out.request_id, ())):   # the next of several steps
                result.request_outputs += [self._request_output(rid, choices, last[rid], now)
                                           for rid, choices in deltas.items()]
                deltas = {}
            deltas.setdefault(out.request_id, []).append(self._choice(state, out, result.stops))
            last[out.request_id] = out
        for rid, choices in deltas.items():
            result.request_outputs.append(self._request_output(rid, choices, last[rid], now))
        return result

    def _choice(self, state: _RequestState, out: EngineCoreOutput,
                stops: list[tuple[str, int, str]]) -> CompletionOutput:
        """One choice's delta: text from its detokenizer, stop strings applied."""
        if out.first_token_time is not None:
            first = state.first_token_time
            state.first_token_time = out.first_token_time if first is None else min(first, out.first_token_time)
        decode = self.tokenizer if state.detokenize else None   # None: logprobs without decoded tokens (vLLM's)
        if out.prompt_logprobs is not None:
            for position in out.prompt_logprobs:
                fill_decoded_tokens(decode, position)
            state.prompt_logprobs = out.prompt_logprobs
        for position in out.new_logprobs or []:
            fill_decoded_tokens(decode, position)
        detok = state.detokenizers[out.index]
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        text, stop = "", None
        token_ids, logprobs, dropped = list(out.new_token_ids), out.new_logprobs, 0
        if token_ids:  # a stop token id (or EOS) that ended the choice stays out of the text
            text, stop, used = _detokenize(detok, out)
            if used < len(token_ids):  # a stop string ended the choice before the last of several new tokens
                dropped = len(token_ids) - used
                token_ids = token_ids[:used]
                logprobs = None if logprobs is None else logprobs[:used]
        if stop is not None:  # a stop string wins over a length limit hit by the same token
            if finish_reason is None:
                stops.append((out.request_id, out.index, stop))
            finish_reason, stop_reason = "stop", stop
        elif finish_reason is not None:
            text += detok.flush()
        if finish_reason is not None:
            state.finished[out.index] = True
        return CompletionOutput(
            index=out.index, text=text, token_ids=token_ids, logprobs=logprobs,
            finish_reason=finish_reason, stop_reason=stop_reason, num_generated_tokens=out.num_output_tokens - dropped)

    def _request_output(self, rid: str, choices: list[CompletionOutput], last: EngineCoreOutput,
                        now: float) -> RequestOutput:
        """Assemble a request's choices; a request whose choices all finished is forgotten."""
        state = self._requests[rid]
        all_done = all(state.finished)
        if all_done:
            del self._requests[rid]
        return RequestOutput(
            request_id=rid, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=sorted(choices, key=lambda o: o.index), finished=all_done,
            prompt_logprobs=state.prompt_logprobs, num_cached_tokens=last.num_cached_tokens,
            metrics=RequestMetrics(arrival_time=last.arrival_time, first_scheduled_time=last.first_scheduled_time,
                                   first_token_time=state.first_token_time, last_token_time=now,
                                   finished_time=now if all_done else None, max_tokens_param=state.max_tokens,
                                   n_param=len(state.finished)),
        )


def merge_delta(finals: dict[str, RequestOutput], delta: RequestOutput) -> RequestOutput:
    """Fold a delta ``RequestOutput`` into the cumulative one in ``finals`` (created on its first delta); return
    that one."""
    final = finals.get(delta.request_id)
    if final is None:
        final = finals[delta.request_id] = RequestOutput(
            request_id=delta.request_id, prompt=delta.prompt, prompt_token_ids=delta.prompt_token_ids, outputs=[])
    by_index = {o.index: o for o in final.outputs}
    for d in delta.outputs:
        c = by_index.get(d.index)
        if c is None:
            c = by_index[d.index] = CompletionOutput(index=d.index, logprobs=None if d.logprobs is None else [])
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:      # in place: a new list per delta copied every position so far, per step
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(d.logprobs)
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        c.num_generated_tokens = d.num_generated_tokens
    final.outputs = [by_index[i] for i in sorted(by_index)]
    final.finished = delta.finished
    final.prompt_logprobs = delta.prompt_logprobs
    if delta.metrics is not None:       # an abort's output has none: the last step's stay
        final.num_cached_tokens, final.metrics = delta.num_cached_tokens, delta.metrics
    return final


def _copy_of_choices(so_far: RequestOutput, indices: set[int]) -> RequestOutput:
    """``so_far`` holding copies of its choices of ``indices`` (vLLM's cumulative outputs name the choices with
    news)."""
    choices = [dataclasses.replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else
                                   list(c.logprobs)) for c in so_far.outputs if c.index in indices]
    return dataclasses.replace(so_far, outputs=choices)


def _detokenize(detok, out: EngineCoreOutput) -> tuple[str, str | None, int]:
    """(text, stop string or None, tokens used) of a choice's new tokens. Several new tokens (accepted
    speculative proposals) go in one at a time, as the engine without speculation would have sent them, so a stop
    string ends the choice at the same token with the same text."""
    ids = out.new_token_ids
    if len(ids) == 1:
        text, stop = detok.update(ids, stop_terminated=out.stop_terminated)
        return text, stop, 1
    text = ""
    for i, token in enumerate(ids):
        delta, stop = detok.update([token], stop_terminated=out.stop_terminated and i == len(ids) - 1)
        text += delta
        if stop is not None:
            return text, stop, i + 1
    return text, None, len(ids)
