"""Several greedy decode steps per scheduler call (``num_scheduler_steps``, ``engine/core/multi_step.py``) on the
embedded SmolLM2 (4-bit layers, 8-bit head): every request's outputs (tokens, text, finish and stop reasons,
logprobs) are those of one step per call, for a mix of greedy requests that end by EOS, a stop token id, a stop
string, ``max_tokens`` or ``min_tokens``, parallel samples, logprobs and a seeded sampled request beside them;
and the calls of several steps do run."""

from __future__ import annotations

import logging

import pytest

from engine.core import multi_step
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to ten.",
             "Write a haiku about the sea.", "What is 2 + 2?"]


def _requests(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    prompts += prompts[:3]
    params = [SamplingParams(temperature=0, max_tokens=80),                      # ends by EOS
              SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),     # by max_tokens
              SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[198]), # by a stop token id
              SamplingParams(temperature=0, max_tokens=60, stop=[" and", "."]),   # by a stop string
              SamplingParams(temperature=0, max_tokens=9, min_tokens=5, n=2),    # min_tokens, parallel samples
              SamplingParams(temperature=0, max_tokens=12, logprobs=2),          # logprobs: one step at a time
              SamplingParams(temperature=0.8, seed=3, max_tokens=20),            # sampled: one step at a time
              SamplingParams(temperature=0, max_tokens=3)]
    return prompts, params


def _run(steps: int) -> tuple[list, list, object]:
    """(every choice's final output, every delta the engine's steps reported: what a stream's chunks carry, the
    engine's ``EngineStats`` at the end)."""
    llm = LLM(num_threads=2, num_scheduler_steps=steps, kv_cache_memory="64MiB")
    deltas = []
    step = llm.engine.step

    def recording():
        outs = step()
        deltas.extend((o.request_id, [(c.index, list(c.token_ids), c.text, c.finish_reason) for c in o.outputs])
                      for o in outs)
        return outs

    llm.engine.step = recording
    prompts, params = _requests(llm)
    outs = llm.generate(prompts, params)       # together: a batch in which some may not take several steps
    outs += [llm.generate([p], q)[0] for p, q in zip(prompts, params)]   # alone: those that may, do
    outputs = [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for o in outs for c in o.outputs]
    return outputs, deltas, llm.engine.get_stats()


@pytest.mark.slow
def test_several_steps_per_call_give_the_outputs_of_one(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tandem.engine")
    counted: list[int] = []
    original = ModelRunner._decode_steps

    def counting(self, out):
        counted.append(out.num_steps)
        return original(self, out)

    monkeypatch.setattr(ModelRunner, "_decode_steps", counting)
    one, one_deltas, one_stats = _run(1)
    assert not counted
    several, several_deltas, several_stats = _run(8)
    assert counted and max(counted) == 8
    assert several == one
    assert several_deltas == one_deltas   # each step's token its own delta, as one step per call gives them
    # and each step of a call is its own sample of vllm:iteration_tokens_total: the same steps as one a call,
    # but for a step a stop string's request may run more or less in the core (the front end ends it)
    assert abs(sum(several_stats.iteration_tokens) - sum(one_stats.iteration_tokens)) <= 2
    assert abs(several_stats.iteration_tokens_sum - one_stats.iteration_tokens_sum) <= 2
    assert sum(one_stats.iteration_tokens) > 200
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert ["num_scheduler_steps=1" in ready[0], "num_scheduler_steps=8" in ready[1]] == [True, True]
    reasons = {r[2] for r in one}
    assert reasons == {"stop", "length"}
    assert any(r[3] == 198 for r in one) and any(r[3] in (" and", ".") for r in one)


def test_the_steps_fit_the_bytes_a_call_may_read():
    budget = multi_step.MULTI_STEP_BYTES
    assert multi_step.steps_allowed(8, budget // 10) == 8
    assert multi_step.steps_allowed(8, budget // 5) == 5
    assert multi_step.steps_allowed(8, budget * 2) == multi_step.steps_allowed(1, budget // 100) == 1
