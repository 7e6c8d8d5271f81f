"""The offline ``LLM`` as a vLLM user calls it (a trial at 90392f4): ``chat`` takes vLLM's keyword arguments and
renders what ``POST /v1/chat/completions`` renders for the same fields (refusing, by name, what this engine cannot
honour); ``embed`` answers vLLM's ``EmbeddingRequestOutput``s with the core's vectors bit for bit; ``encode`` is
vLLM's pooling entry point for the "embed" task. A tiny random Llama in float32 (byte-level tokenizer)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.llm import LLM
from engine.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from engine.pooling import PoolingParams
from engine.output_processor import merge_delta
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.serving.chat import render_chat
from tests.tiny_models import save_byte_level_llama

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": CITY}}]
PROMPTS = ["hello world", "a", "the quick brown fox"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(save_byte_level_llama(tmp_path_factory.mktemp("tiny-llm")), dtype="float32", kv_cache_memory="16MiB")


def served(llm: LLM, **fields) -> list[int]:
    """The prompt the chat endpoint renders for a body of ``fields`` (its messages default to ``CONV``)."""
    return list(render_chat(llm.tokenizer, {"messages": CONV, **fields}).prompts[0][1])


def text_of(llm: LLM, ids: list[int]) -> str:
    return llm.tokenizer.decode(ids, skip_special_tokens=False)


def test_chat_takes_vllms_arguments_and_renders_as_the_chat_endpoint(llm):
    plain = llm.chat(CONV, GREEDY)[0]
    assert plain.prompt_token_ids == served(llm)
    same = llm.chat(CONV, GREEDY, use_tqdm=False, lora_request=None, chat_template_content_format="string",
                    mm_processor_kwargs=None)[0]
    assert (same.prompt_token_ids, same.outputs[0].token_ids) == (plain.prompt_token_ids, plain.outputs[0].token_ids)
    bare = llm.chat(CONV, GREEDY, add_generation_prompt=False)[0].prompt_token_ids
    assert bare == served(llm, add_generation_prompt=False) and text_of(llm, plain.prompt_token_ids).startswith(
        text_of(llm, bare)) and not text_of(llm, bare).endswith("assistant\n")
    prefill = CONV + [{"role": "assistant", "content": '{"a": "'}]
    cont = llm.chat(prefill, GREEDY, add_generation_prompt=False, continue_final_message=True)[0].prompt_token_ids
    assert cont == served(llm, messages=prefill, add_generation_prompt=False, continue_final_message=True)
    assert text_of(llm, cont).endswith('assistant\n{"a": "')
    with pytest.raises(ValueError, match="continue_final_message"):      # vLLM's rule: not with a generation prompt
        llm.chat(prefill, GREEDY, continue_final_message=True)
    with_tools = llm.chat(CONV, GREEDY, tools=TOOLS)[0].prompt_token_ids
    assert with_tools == served(llm, tools=TOOLS) and "get_weather" in text_of(llm, with_tools)


def test_chat_template_and_its_kwargs(llm):
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}{{ cue }}{% endif %}")
    ids = llm.chat(CONV, GREEDY, chat_template=template, chat_template_kwargs={"cue": ">>"})[0].prompt_token_ids
    assert text_of(llm, ids) == "[system]be brief[user]hi>>"
    assert llm.chat(CONV, GREEDY)[0].prompt_token_ids == served(llm)     # the model's own template again after
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat(CONV, GREEDY, chat_template="{% for m in messages %}")


@pytest.mark.parametrize("kwargs, named", [
    ({"lora_request": object()}, "lora_request"),
    ({"mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs"),
    ({"chat_template_content_format": "openai"}, "chat_template_content_format"),
])
def test_chat_refuses_by_name_what_it_cannot_honour(llm, kwargs, named):
    with pytest.raises(ValueError, match=named):
        llm.chat(CONV, GREEDY, **kwargs)


def test_embed_answers_vllms_embedding_request_outputs(llm):
    ids = [llm.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    want = llm.engine.core.embed(ids)                                    # the core's vectors, as embed returned
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outs)
    assert [o.outputs.embedding for o in outs] == want                    # bit for bit
    assert [o.prompt_token_ids for o in outs] == ids and [o.outputs.hidden_size for o in outs] == [64] * 3
    assert len({o.request_id for o in outs}) == 3
    assert llm.embed({"prompt_token_ids": ids[0]})[0].outputs.embedding == want[0]   # vLLM's prompt dict
    with pytest.raises(ValueError, match="lora_request"):
        llm.embed(PROMPTS, lora_request=object())


def test_encode_pools_the_embed_task(llm):
    outs = llm.encode(PROMPTS, pooling_task="embed")
    assert all(isinstance(o, PoolingRequestOutput) for o in outs)
    assert all(o.outputs.data.dtype == torch.float32 and o.outputs.data.shape == (64,) for o in outs)
    assert [o.outputs.data.tolist() for o in outs] == [o.outputs.embedding for o in llm.embed(PROMPTS)]
    mean = llm.encode(PROMPTS[:1], PoolingParams("MEAN", False), pooling_task="embed")[0].outputs.data.tolist()
    assert mean == llm.embed(PROMPTS[:1], pooling_type="MEAN", normalize=False)[0].outputs.embedding
    for task in (None, "classify"):
        with pytest.raises(ValueError, match="pooling_task"):
            llm.encode(PROMPTS, pooling_task=task)


def test_detokenize_false_answers_token_ids_and_no_text(llm):
    """vLLM's ``SamplingParams(detokenize=False)`` (a trial's "unexpected keyword argument"): the same tokens and
    logprobs as with text, ``text`` empty and no decoded tokens; the text path itself unchanged."""
    params = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1, n=2)
    with_text = llm.generate(PROMPTS, SamplingParams(**params))
    ids_only = llm.generate(PROMPTS, SamplingParams(detokenize=False, **params))
    for a, b in zip(with_text, ids_only):
        assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
        assert [(c.finish_reason, c.num_generated_tokens) for c in b.outputs] == \
            [(c.finish_reason, c.num_generated_tokens) for c in a.outputs]
        assert all(c.text == "" for c in b.outputs)
        assert [c.text for c in a.outputs] == [llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                                              for c in a.outputs] and any(c.text for c in a.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert [{t: lp.logprob for t, lp in p.items()} for p in y.logprobs] == \
                [{t: lp.logprob for t, lp in p.items()} for p in x.logprobs]
            assert all(lp.decoded_token for p in x.logprobs for lp in p.values())
            assert not any(lp.decoded_token for p in y.logprobs for lp in p.values())
        assert not any(lp.decoded_token for p in b.prompt_logprobs[1:] for lp in p.values())
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        llm.generate(PROMPTS, SamplingParams(detokenize=False, stop=["x"]))


def choices(outputs) -> list:
    return [[(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outputs]


def test_output_kind_generate_answers_final_outputs_and_step_what_the_kind_asks(llm):
    """vLLM's ``output_kind`` (a trial's "unexpected keyword argument"): ``LLM.generate`` runs every request as
    FINAL_ONLY, as vLLM's does, so each kind answers the same (the caller's params left as given); the engine's
    step loop (vLLM's ``llm_engine.step()``) hands a request's outputs as its kind asks."""
    params = dict(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1, n=2)
    want = llm.generate(PROMPTS, SamplingParams(**params))
    for kind in RequestOutputKind:
        given = SamplingParams(output_kind=kind, **params)
        assert choices(llm.generate(PROMPTS, given)) == choices(want) and given.output_kind is kind
    engine = llm.llm_engine
    for kind in RequestOutputKind:
        engine.add_request(f"step-{kind.name}", PROMPTS[0], SamplingParams(output_kind=kind, **params))
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    deltas, cumulative, (final,) = got["step-DELTA"], got["step-CUMULATIVE"], got["step-FINAL_ONLY"]
    assert choices([final]) == choices(want[:1]) and final.finished
    assert len(cumulative) == len(deltas) > 1 and [o.finished for o in cumulative] == [o.finished for o in deltas]
    for i, out in enumerate(cumulative):   # each choice with news: the deltas so far, merged
        so_far = {}
        for delta in deltas[:i + 1]:
            merge_delta(so_far, delta)
        news = {c.index for c in deltas[i].outputs}
        assert choices([out]) == [[c for c in choices(so_far.values())[0] if c[0] in news]]


def test_n_beyond_max_num_seqs_runs_in_turns_each_child_as_its_seed_alone(tmp_path):
    """vLLM v1 schedules each child on its own, so ``n`` above ``max_num_seqs`` is served (a trial got a 400): the
    choices past the first ``max_num_seqs`` form further fork groups, admitted as seats free; every child is
    still the request with seed ``seed + index`` alone, bit for bit."""
    llm = LLM(save_byte_level_llama(tmp_path), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=2)
    sampled = dict(temperature=0.9, max_tokens=6, ignore_eos=True, logprobs=1)
    family = llm.generate("hello world", SamplingParams(n=5, seed=7, **sampled))[0]
    assert sorted(c.index for c in family.outputs) == list(range(5))
    for child in family.outputs:
        alone = llm.generate("hello world", SamplingParams(seed=7 + child.index, **sampled))[0].outputs[0]
        assert child.token_ids == alone.token_ids and len(child.token_ids) == 6
        assert [lp[t].logprob for t, lp in zip(child.token_ids, child.logprobs)] == \
            [lp[t].logprob for t, lp in zip(alone.token_ids, alone.logprobs)]
    assert len({tuple(c.token_ids) for c in family.outputs}) > 1   # sampled: the seeds differ


def test_a_dropped_llm_frees_its_model(tmp_path):
    """An engine freezes its start-up heap out of the cyclic GC (serving latency, issue #34), and its model's layers
    sit in reference cycles: frozen, every LLM built and dropped in one process kept its weights and KV pool (the
    suite's two workers reached 13.5 and 6 GB resident, ~470 MB per SmolLM2 engine). Dropped and collected, its
    layers are gone, and a second engine's too."""
    path = save_byte_level_llama(tmp_path)
    for _ in range(2):
        llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
        assert llm.generate("hi", GREEDY)[0].outputs[0].token_ids
        layer = weakref.ref(llm.llm_engine.model_runner.model.layers[0])
        del llm
        gc.collect()
        assert layer() is None
