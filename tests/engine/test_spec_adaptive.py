"""How many tokens a sequence proposes (``engine/spec_decode/adaptive.py``, ``proposing.py``): as many as its
acceptance rate makes worth their cost on the measured step-cost line; none where they cannot pay (many
sequences decoding, or guesses that keep failing), and again after a while."""

from __future__ import annotations

from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode.adaptive import Acceptance, StepCost, worth_proposing
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposing import SpecDecoder


def test_worth_proposing_is_the_longest_prefix_likely_enough():
    assert worth_proposing(0.5, 0.14, 4) == 2          # 0.25 >= 0.14 > 0.125
    assert worth_proposing(0.9, 0.5, 4) == 4           # capped at k
    assert worth_proposing(0.9, 0.95, 4) == 0          # not even one token
    assert worth_proposing(0.99, 1.1, 8) == 0          # a token that cannot pay for itself
    assert worth_proposing(0.3, 0.0, 3) == 3


def test_acceptance_rate_follows_recent_proposals():
    a = Acceptance()
    assert a.rate == 0.5 and a.next_k(0.14, 4) == 2
    for _ in range(6):
        a.observe(4, 0)
    assert a.rate < 0.1
    for _ in range(6):
        a.observe(4, 4)
    assert a.rate > 0.9 and a.next_k(0.14, 4) == 4


def test_step_cost_threshold_from_the_measured_line():
    cost = StepCost()
    at = 0.0
    for t in [1, 5, 1, 3, 9, 2, 1, 5] * 10:   # 14 ms per step + 1.6 ms per query token
        at += 0.1
        cost.observe(0.014 + 0.0016 * t, t, at)
    assert abs(cost.threshold(1) - 1.25 * 0.0016 / 0.0156) < 0.01
    assert cost.threshold(64) > 1.0                # a verify token costs what it saves at best


class _Always:
    """A proposer that guesses token 7, k times."""

    def __init__(self):
        self.asked: list[int] = []

    def propose(self, requests, ks):
        self.asked.extend(ks)
        return [[7] * k for k in ks]

    def forget(self, request_ids):
        pass


def _decoding_request() -> Request:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000), max_tokens=1000)
    req.append_output_token_ids(5)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def _step(decoder: SpecDecoder, req: Request, accepted: int) -> int:
    """One step in which ``accepted`` of the proposal's tokens were accepted; returns how many were proposed."""
    decoder.propose([req])
    spec = list(req.spec_token_ids)
    sched = SchedulerOutput(scheduled=[ScheduledRequest(req, req.num_computed_tokens, 1 + len(spec), [1], True,
                                                        spec)])
    decoder.observe(sched, {req.request_id: [7] * min(accepted, len(spec)) + [9]})
    return len(spec)


def test_failing_guesses_stop_and_are_tried_again():
    decoder = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), 4096, _Always())
    decoder.cost.threshold = lambda rows: 0.14
    req = _decoding_request()
    proposed = [_step(decoder, req, 0) for _ in range(300)]
    assert proposed[0] == 2                          # the prior: alpha 0.5
    probes = [i for i, k in enumerate(proposed) if i > 2 and k]
    assert all(proposed[i] == 1 for i in probes)     # guesses that fail stop, but for a one-token probe...
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:5] == sorted(gaps[:5]) and gaps[-1] == 33    # ...ever rarer: every 33 steps at most
    assert [_step(decoder, req, 99) for _ in range(40)][-1] == 4     # guesses that land again: the full k
    stats = decoder.stats
    assert stats.num_drafts == sum(stats.accepted_per_draft) and stats.accepted_per_draft[0] > 0
    assert stats.accepted_per_draft[4] > 0 and stats.num_accepted_tokens_per_pos[3] == stats.accepted_per_draft[4]


def test_many_sequences_decoding_propose_nothing():
    decoder = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), 4096, _Always())
    at = 0.0
    for t in range(1, 80):
        at += 0.1
        decoder.cost.observe(0.014 + 0.0016 * t, t, at)
    reqs = []
    for i in range(64):
        r = _decoding_request()
        r.request_id = f"r{i}"
        reqs.append(r)
    decoder.propose(reqs)
    assert all(not r.spec_token_ids for r in reqs) and decoder.proposer.asked == []
    decoder.propose(reqs[:1])
    assert reqs[0].spec_token_ids == [7, 7]


class _Never(_Always):
    """A proposer that never finds a match (a text with nothing to copy)."""

    def propose(self, requests, ks):
        self.asked.extend(ks)
        return [[] for _ in ks]


def test_lookups_that_find_nothing_back_off():
    decoder = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), 4096, _Never())
    decoder.cost.threshold = lambda rows: 0.14
    req = _decoding_request()
    assert [_step(decoder, req, 0) for _ in range(300)] == [0] * 300
    assert 5 < len(decoder.proposer.asked) < 30       # asked ever more rarely, not at each of the 300 steps
    assert decoder.stats.num_drafts == 0              # nothing verified, nothing counted


def test_the_method_is_inferred_from_the_model_as_vllm_does():
    """A vLLM command line names the draft model without ``method`` (a trial: refused here before)."""
    import pytest

    assert SpeculativeConfig.parse('{"model": "draft.gguf", "num_speculative_tokens": 3}').method == "draft_model"
    for model in ("[ngram]", "ngram", None):
        cfg = SpeculativeConfig(model=model, num_speculative_tokens=3)
        assert (cfg.method, cfg.model) == ("ngram", None)
    with pytest.raises(ValueError, match="only read by method draft_model"):
        SpeculativeConfig(method="ngram", model="draft.gguf")


def test_vllms_config_runs_as_written():
    """A trial: ``prompt_lookup_min`` 5 alone was refused against a maximum the user never set, and vLLM's
    ``draft_tensor_parallel_size`` refused as unknown. One bound alone is the other too (vLLM's rule); vLLM's keys
    that change nothing here are taken, and said (once, by the engine's start: ``unused_keys``); a key of neither
    is still refused."""
    import pytest

    from engine.spec_decode.config import unused_keys

    assert (SpeculativeConfig(prompt_lookup_min=5).prompt_lookup_max, SpeculativeConfig(
        prompt_lookup_max=1).prompt_lookup_min) == (5, 1)
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (2, 4)
    text = ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
            '"draft_tensor_parallel_size": 1, "disable_by_batch_size": 8}')
    cfg = SpeculativeConfig.parse(text)
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max) == (5, 4)
    notes = unused_keys(text)
    assert [n.split(" taken")[0] for n in notes] == ["speculative_config.disable_by_batch_size=8",
                                                      "speculative_config.draft_tensor_parallel_size=1"]
    assert unused_keys(None) == [] and unused_keys({"method": "ngram"}) == []
    with pytest.raises(ValueError, match="unknown key.*frobnicate"):
        SpeculativeConfig.parse({"frobnicate": 1})
    with pytest.raises(ValueError, match="max_model_len"):
        SpeculativeConfig.parse({"model": "d.gguf", "max_model_len": 0})
