"""OutputProcessor: the front end's half of a step (fast: a character tokenizer, no model).

The core in its own process may run one more step for a choice that a stop
string already ended in the front end; that output must be dropped, the stop
must be reported once, and the request must finish exactly once.
"""

from __future__ import annotations

import msgspec

from engine.core.core_messages import EngineCoreOutput
from engine.output_processor import OutputProcessor
from engine.outputs import Logprob
from engine.sampling_params import RequestOutputKind, SamplingParams


class CharTokenizer:
    """Token id = a character's code point."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def core_output(rid: str, index: int, text: str, n_out: int, finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=rid, index=index, new_token_ids=[ord(c) for c in text], new_logprobs=None,
        finish_reason=finish, stop_reason=None, stop_terminated=False, num_output_tokens=n_out,
        num_cached_tokens=0, arrival_time=0.0, first_scheduled_time=0.0, first_token_time=1.0)


def test_stop_string_is_reported_once_and_late_core_outputs_are_dropped():
    proc = OutputProcessor(CharTokenizer())
    proc.add_request("r", None, [ord("p")], SamplingParams(n=2, stop=["xy"], max_tokens=10))
    first = proc.process_outputs([core_output("r", 0, "a", 1), core_output("r", 1, "b", 1)], 2.0)
    assert [c.text for c in first.request_outputs[0].outputs] == ["a", "b"] and not first.stops
    held = proc.process_outputs([core_output("r", 0, "x", 2)], 3.0)
    assert held.request_outputs[0].outputs[0].text == "" and not held.stops  # "x" may start "xy": held back
    second = proc.process_outputs([core_output("r", 0, "y", 3)], 3.5)
    assert second.stops == [("r", 0, "xy")]
    (out,) = second.request_outputs
    assert [(c.index, c.text, c.finish_reason, c.stop_reason) for c in out.outputs] == [(0, "", "stop", "xy")]
    assert not out.finished  # choice 1 still runs
    late = proc.process_outputs([core_output("r", 0, "z", 4), core_output("r", 1, "c", 2, finish="length")], 4.0)
    (out,) = late.request_outputs
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [(1, "c", "length")]
    assert out.finished and out.metrics.finished_time == 4.0 and "r" not in proc
    assert proc.process_outputs([core_output("r", 1, "d", 3)], 5.0).request_outputs == []


def test_abort_reports_only_unfinished_choices():
    proc = OutputProcessor(CharTokenizer())
    proc.add_request("r", "p", [ord("p")], SamplingParams(n=2, max_tokens=5))
    proc.process_outputs([core_output("r", 1, "a", 1, finish="length")], 1.0)
    out = proc.abort_request("r")
    assert out.finished and [(c.index, c.finish_reason) for c in out.outputs] == [(0, "abort")]
    assert proc.abort_request("r") is None and proc.num_requests == 0


def kinds_run(kind: RequestOutputKind) -> tuple[list, OutputProcessor]:
    """Two choices over three steps (the last two in one call, as a multi-step core sends them); what
    ``as_asked`` hands the request's consumer under ``kind``, and the processor."""
    proc = OutputProcessor(CharTokenizer())
    proc.add_request("r", "p", [ord("p")], SamplingParams(n=2, max_tokens=3, output_kind=kind))
    asked = proc.as_asked(proc.process_outputs([core_output("r", 0, "a", 1), core_output("r", 1, "b", 1)],
                                               1.0).request_outputs)
    asked += proc.as_asked(proc.process_outputs([core_output("r", 0, "c", 2), core_output("r", 0, "e", 3, "length"),
                                                 core_output("r", 1, "d", 2, "length")], 2.0).request_outputs)
    return asked, proc


def test_output_kind_shapes_what_the_consumer_gets_as_vllm_does():
    """vLLM's ``RequestOutputKind`` (a trial's "unexpected keyword argument"): DELTA as the processor makes them;
    CUMULATIVE each choice with news whole so far; FINAL_ONLY one output, every choice whole."""
    deltas, _ = kinds_run(RequestOutputKind.DELTA)
    assert [[(c.index, c.text) for c in o.outputs] for o in deltas] == [[(0, "a"), (1, "b")], [(0, "c")],
                                                                      [(0, "e"), (1, "d")]]
    cumulative, proc = kinds_run(RequestOutputKind.CUMULATIVE)
    assert [[(c.index, c.text, c.token_ids) for c in o.outputs] for o in cumulative] == [
        [(0, "a", [97]), (1, "b", [98])], [(0, "ac", [97, 99])], [(0, "ace", [97, 99, 101]), (1, "bd", [98, 100])]]
    assert [o.finished for o in cumulative] == [False, False, True] and not proc._kinds and not proc._so_far
    (final,), proc = kinds_run(RequestOutputKind.FINAL_ONLY)
    assert final.finished and [(c.text, c.finish_reason) for c in final.outputs] == [("ace", "length"),
                                                                                 ("bd", "length")]
    assert final.prompt == "p" and not proc._kinds and not proc._so_far


def test_an_aborted_request_ends_as_its_kind_asks_and_a_forgotten_one_leaves_nothing():
    proc = OutputProcessor(CharTokenizer())
    for rid in ("final", "forgotten"):
        proc.add_request(rid, None, [ord("p")], SamplingParams(max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY))
    assert proc.as_asked(proc.process_outputs([core_output("final", 0, "ab", 2)], 1.0).request_outputs) == []
    (out,) = proc.as_asked([proc.abort_request("final")])
    assert out.finished and [(c.text, c.finish_reason) for c in out.outputs] == [("ab", "abort")]
    # what the earlier outputs said of the request stays (a trial's aborted FINAL_ONLY request had lost them)
    assert out.prompt_token_ids == [ord("p")] and out.metrics.first_token_time == 1.0
    proc.forget("forgotten")
    assert not proc._kinds and not proc._so_far


def test_an_aborted_requests_last_output_keeps_its_prompt_logprobs_under_every_kind():
    """The abort's output is the last a CUMULATIVE or FINAL_ONLY consumer reads whole: the prompt's logprobs the
    first step carried must not turn into None there (nor in a DELTA consumer's final output)."""
    position = {ord("q"): Logprob(logprob=-0.5, rank=1)}
    for kind in RequestOutputKind:
        proc = OutputProcessor(CharTokenizer())
        proc.add_request("r", "pq", [ord("p"), ord("q")], SamplingParams(max_tokens=5, output_kind=kind,
                                                                          prompt_logprobs=0))
        first = msgspec.structs.replace(core_output("r", 0, "a", 1), prompt_logprobs=[None, position])
        proc.as_asked(proc.process_outputs([first], 1.0).request_outputs)
        (out,) = proc.as_asked([proc.abort_request("r")])
        assert out.prompt_logprobs == [None, position] and out.prompt == "pq", kind
