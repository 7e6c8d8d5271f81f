"""OutputProcessor: the front end's half of a step (fast: a character tokenizer, no model).

The core in its own process may run one more step for a choice that a stop
string already ended in the front end; that output must be dropped, the stop
must be reported once, and the request must finish exactly once.
"""

from __future__ import annotations

from engine.core.core_messages import EngineCoreOutput
from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams


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
