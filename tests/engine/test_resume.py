"""A continuation equals the uninterrupted answer (issue #30): a request resumed from any output position k
(prompt + its first k tokens re-prefilled, ``LLMEngine.add_request(resume=...)``) produces tokens k+1.. with the
same ids and logprobs and the same text as the request run in one piece: greedy and seeded sampling (the
sampler's draw for position k depends only on the seed, the choice and k), across a stop string, and for
``n = 2``. SmolLM2 in bfloat16 (the batch-invariant default); every continuation runs in one batch."""

from __future__ import annotations

import json

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.llm import LLM
from engine.output_processor import merge_delta
from engine.sampling_params import SamplingParams
from loadtests.workloads import MT_BENCH_PATH

pytestmark = pytest.mark.slow

LENGTH = 32     # every position is resumed: the work grows with its square
GREEDY = SamplingParams(temperature=0.0, max_tokens=LENGTH, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=LENGTH, logprobs=2, ignore_eos=True)


def _key(c) -> list[tuple]:
    return [(t, tuple(sorted((k, v.logprob) for k, v in lp.items()))) for t, lp in zip(c.token_ids, c.logprobs)]


def _run(llm: LLM, requests: dict[str, tuple]) -> dict:
    """Every ``(prompt ids, params, resume)`` of ``requests`` submitted at once; final outputs by id."""
    engine, finals = llm.engine, {}
    for rid, (ids, params, resume) in requests.items():
        engine.add_request(rid, ids, params, resume=resume)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            merge_delta(finals, delta)
    return finals


def _primed_text(llm: LLM, ids: list[int], params: SamplingParams, done: list[int]) -> str:
    """The text a client had received after ``done`` (what the first engine's detokenizer emitted)."""
    detok = IncrementalDetokenizer(llm.tokenizer, ids, params)
    detok.update(done)
    return detok.output_text


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="bfloat16", kv_cache_memory="384MiB", max_num_seqs=256)


def test_continuation_from_every_position_equals_uninterrupted(llm):
    question = json.loads(MT_BENCH_PATH.read_text()
                          .splitlines()[0])["turns"][0]
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    seeded2 = SamplingParams(**{**SEEDED.__dict__, "n": 2})
    full = _run(llm, {"greedy": (ids, GREEDY, None), "seeded": (ids, SEEDED, None), "n2": (ids, seeded2, None)})
    text = full["greedy"].outputs[0].text
    stop = text[len(text) // 3:len(text) // 3 + 5]       # a stop string in the middle of the greedy answer
    stopped_params = SamplingParams(**{**GREEDY.__dict__, "stop": [stop]})
    stopped = _run(llm, {"stop": (ids, stopped_params, None)})["stop"].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < LENGTH

    cases = {"greedy": GREEDY, "seeded": SEEDED}
    requests = {f"{name}-{k}": (ids, params, {0: full[name].outputs[0].token_ids[:k]})
                for name, params in cases.items() for k in range(LENGTH)}
    requests |= {f"stop-{k}": (ids, stopped_params, {0: stopped.token_ids[:k]}) for k in range(len(stopped.token_ids))}
    n2 = [c.token_ids for c in full["n2"].outputs]
    requests |= {f"n2-{k}": (ids, seeded2, {0: n2[0][:k], 1: n2[1][:LENGTH - 1 - k]}) for k in range(0, LENGTH, 9)}
    resumed = _run(llm, requests)
    # usage's cached tokens are prompt tokens: a continuation re-prefills its own earlier output from the cache
    # too (a trial's resumed stream reported 80 cached of 51 prompt tokens)
    cached = [r.num_cached_tokens for r in resumed.values()]
    assert max(cached) == len(ids) and min(cached) >= 0

    for name, params in {**cases, "stop": stopped_params}.items():
        whole = stopped if name == "stop" else full[name].outputs[0]
        for k in range(len(whole.token_ids)):
            cont = resumed[f"{name}-{k}"].outputs
            assert len(cont) == 1 and cont[0].index == 0
            assert _key(cont[0]) == _key(whole)[k:], (name, k)
            assert _primed_text(llm, ids, params, whole.token_ids[:k]) + cont[0].text == whole.text, (name, k)
            assert (cont[0].finish_reason, cont[0].stop_reason) == (whole.finish_reason, whole.stop_reason)
            assert cont[0].num_generated_tokens == len(whole.token_ids)     # counted from the original start
    for k in range(0, LENGTH, 9):
        cont = resumed[f"n2-{k}"].outputs
        assert [c.index for c in cont] == [0, 1]
        assert _key(cont[0]) == _key(full["n2"].outputs[0])[k:]
        assert _key(cont[1]) == _key(full["n2"].outputs[1])[LENGTH - 1 - k:]
    assert n2[0] != n2[1] and full["seeded"].outputs[0].token_ids == n2[0]    # child i == seed + i alone


def test_continuation_is_refused_when_it_cannot_continue(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, n=2)
    for resume in ({}, {2: [1]}, {0: [1, 2, 3, 4]}, {0: [-1]}):
        with pytest.raises(ValueError, match="resume"):
            llm.engine.add_request("r", [1, 2, 3], params, resume=resume)
