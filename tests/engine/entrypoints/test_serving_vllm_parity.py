"""Where ``tandem engine serve`` answers as ``vllm serve`` does, found wanting by a vLLM user's trial: fields
refused rather than ignored (``prompt_logprobs`` on a stream, a request ``chat_template``), ``return_token_ids``
on both endpoints streamed or not, a stop token's text with ``include_stop_str_in_output``, ``"max_tokens":
null`` and ``echo`` with ``max_tokens`` 0 on /v1/completions, the utility endpoints (``/tokenize``, ``/detokenize``, ``/version``, ``/ping``), and
the embeddings' ``id``/``created`` and the models' ``permission``.

Real HTTP against conftest.py's SmolLM2 float32 server (shared with test_serving.py), the official ``openai``
client and httpx.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.engine.entrypoints.test_serving import (MAX_MODEL_LEN, chat, chat_stream, complete, complete_stream,
                                                   concurrently)

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Hi"}]
DOT = 30   # SmolLM2's "."


@pytest.fixture
def server(float32_server):
    return float32_server


def test_prompt_logprobs_on_a_stream_is_refused_as_vllm_refuses_it(server):
    """A trial's streamed request with ``prompt_logprobs`` got 200 and no prompt logprobs anywhere."""
    for call in (lambda: complete_stream(server, prompt="hi", max_tokens=2, extra_body={"prompt_logprobs": 1}),
                 lambda: chat_stream(server, messages=HI, max_tokens=2, extra_body={"prompt_logprobs": 1})):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert exc.value.body["param"] == "prompt_logprobs", exc.value.body
        assert exc.value.body["message"] == "`prompt_logprobs` are not available when `stream=True`."
        assert exc.value.body["code"] == "invalid_value"        # a trial's had code null
    with pytest.raises(openai.BadRequestError) as exc:          # fcfs here: a priority is refused, with a code too
        chat(server, messages=HI, max_tokens=2, extra_body={"priority": 5})
    assert (exc.value.body["param"], exc.value.body["code"]) == ("priority", "invalid_value")


def test_a_request_chat_template_is_refused_never_ignored(server):
    """A trial's ``chat_template`` was silently replaced by the model's; vLLM (without
    --trust-request-chat-template) refuses it."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(openai.BadRequestError) as exc:
        chat(server, messages=HI, max_tokens=2, extra_body={"chat_template": template})
    assert exc.value.body["param"] == "chat_template" and "template" in exc.value.message
    r = httpx.post(f"{server.base_url}/tokenize", json={"model": server.model, "messages": HI,
                                                        "chat_template": template})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_return_token_ids_on_both_endpoints_streamed_or_not(server):
    """vLLM's shape: chat ``prompt_token_ids`` top level (each role chunk of a stream), completions per choice
    (its first chunk); ``token_ids`` per choice (each chunk's new ones). A trial got them only on streamed chat."""
    ids = {"return_token_ids": True}
    full_c, stream_c, full_chat, stream_chat = concurrently(
        lambda: complete(server, prompt="The capital of France is", max_tokens=5, temperature=0, extra_body=ids),
        lambda: complete_stream(server, prompt="The capital of France is", max_tokens=5, temperature=0,
                                extra_body=ids),
        lambda: chat(server, messages=HI, max_tokens=5, temperature=0, extra_body=ids),
        lambda: chat_stream(server, messages=HI, max_tokens=5, temperature=0, extra_body=ids))
    tok = server.engine.tokenizer
    prompt_ids = tok.encode("The capital of France is", add_special_tokens=True)
    choice = full_c.choices[0].model_extra
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 5
    assert tok.decode(choice["token_ids"]) == full_c.choices[0].text
    streamed = [c.model_extra for ch in stream_c for c in ch.choices]
    assert streamed[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c or c["prompt_token_ids"] is None for c in streamed[1:])
    assert [t for c in streamed for t in c["token_ids"]] == choice["token_ids"]
    chat_ids = full_chat.model_extra["prompt_token_ids"]
    assert chat_ids and chat_ids[-1] != chat_ids[0] and len(full_chat.choices[0].model_extra["token_ids"]) == 5
    assert stream_chat[0].model_extra["prompt_token_ids"] == chat_ids
    assert [t for ch in stream_chat for c in ch.choices for t in (c.model_extra.get("token_ids") or [])] == \
        full_chat.choices[0].model_extra["token_ids"]
    plain = complete(server, prompt="hi", max_tokens=1).choices[0].model_extra
    assert "token_ids" not in plain and "prompt_token_ids" not in plain   # only when asked for


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_follows_include_stop_str_in_output(server, include):
    """vLLM v1: with ``include_stop_str_in_output`` the stop token's text ends the answer (a trial got " Paris"
    with logprobs [" Paris", "."]); without it the text stops before it. Streamed == whole."""
    kw = dict(prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=0,
              extra_body={"stop_token_ids": [DOT], "include_stop_str_in_output": include})
    whole, chunks = concurrently(lambda: complete(server, **kw), lambda: complete_stream(server, **kw))
    c = whole.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == DOT, c
    tokens = "".join(c.logprobs.tokens)
    assert tokens.endswith(".") and c.text == (tokens if include else tokens[:-1])
    assert "".join(ch.text for chunk in chunks for ch in chunk.choices) == c.text


def test_completions_max_tokens_null_is_the_default_16(server):
    """vLLM 0.32 (``normalize_null_max_tokens``) and OpenAI: an explicit null is the default, 16 tokens (an
    earlier reading filled the context, which the gateway's reservation, 16, did not expect)."""
    body = {"model": server.model, "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}
    url = f"{server.base_url}/v1/completions"
    null, absent = concurrently(lambda: httpx.post(url, json={**body, "max_tokens": None}, timeout=600),
                                lambda: httpx.post(url, json=body, timeout=600))
    assert null.json()["usage"]["completion_tokens"] == absent.json()["usage"]["completion_tokens"] == 16
    assert null.json()["choices"][0]["text"] == absent.json()["choices"][0]["text"]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server):
    """OpenAI's legacy prompt scoring, vLLM's ``echo_without_generation`` (what evaluation harnesses send): the
    prompt's text and logprobs, nothing generated or counted; streamed == whole. They were a 400 (max_tokens
    below 1)."""
    prompt = "The capital of France is Paris."
    kw = dict(prompt=prompt, max_tokens=0, echo=True, logprobs=1, extra_body={"return_token_ids": True})
    # the SDK's own reading (the pydantic types refuse the first token's null logprob, as OpenAI sends it)
    create = server.client.completions.create
    whole, chunks, longer = concurrently(
        lambda: create(model=server.model, **kw), lambda: list(create(model=server.model, stream=True, **kw)),
        lambda: create(model=server.model, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0))
    c = whole.choices[0]
    ids = server.engine.tokenizer.encode(prompt, add_special_tokens=True)
    assert c.text == prompt and c.finish_reason == "length" and c.model_extra["token_ids"] == []
    assert whole.usage.completion_tokens == 0 and whole.usage.prompt_tokens == len(ids)
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    # the prompt's logprobs are those an echo with one generated token shows before it
    assert c.logprobs.token_logprobs == longer.choices[0].logprobs.token_logprobs[:len(ids)]
    assert c.logprobs.top_logprobs == longer.choices[0].logprobs.top_logprobs[:len(ids)]
    streamed = [ch for chunk in chunks for ch in chunk.choices]
    assert "".join(ch.text for ch in streamed) == prompt and streamed[-1].finish_reason == "length"
    assert [t for ch in streamed if ch.logprobs for t in ch.logprobs.token_logprobs] == c.logprobs.token_logprobs
    assert [t for ch in streamed for t in ch.model_extra.get("token_ids") or []] == []
    # 0 is taken only there: without echo, and on chat, it stays below the minimum
    for call, param in ((lambda: complete(server, prompt=prompt, max_tokens=0), "max_tokens"),
                        (lambda: chat(server, messages=HI, max_tokens=0, extra_body={"echo": True}), "max_tokens")):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert exc.value.body["param"] == param and exc.value.body["code"] == "integer_below_min_value"


def test_tokenize_detokenize_version_and_ping(server):
    base, tok = server.base_url, server.engine.tokenizer
    r = httpx.post(f"{base}/tokenize", json={"model": server.model, "prompt": "Hello world"})
    ids = tok.encode("Hello world", add_special_tokens=True)
    assert r.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    r = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                             "return_token_strs": True})
    assert r.json()["tokens"] == tok.encode("Hello world") and len(r.json()["token_strs"]) == r.json()["count"]
    # the chat form renders as the chat endpoint does: its count is the chat answer's prompt_tokens
    rendered = httpx.post(f"{base}/tokenize", json={"model": server.model, "messages": HI}).json()
    assert rendered["count"] == chat(server, messages=HI, max_tokens=1).usage.prompt_tokens
    bare = httpx.post(f"{base}/tokenize", json={"messages": HI, "add_generation_prompt": False}).json()
    assert bare["count"] < rendered["count"] and rendered["tokens"][:bare["count"]] == bare["tokens"]
    r = httpx.post(f"{base}/detokenize", json={"model": server.model, "tokens": rendered["tokens"]})
    assert r.json() == {"prompt": tok.decode(rendered["tokens"], skip_special_tokens=False)}
    assert "<|im_start|>" in r.json()["prompt"]
    for path, body, param in (("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "messages": HI}, "prompt"),   # one form, not both
                              ("/detokenize", {"tokens": [tok.vocab_size]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"messages": []}, "messages")):
        r = httpx.post(base + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"], r.text
    for path, body in (("/tokenize", {"model": "other", "prompt": "x"}), ("/detokenize", {"model": "other",
                                                                                          "tokens": [1]})):
        r = httpx.post(base + path, json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    from importlib.metadata import version
    assert httpx.get(f"{base}/version").json() == {"version": version("tandem")}
    assert httpx.get(f"{base}/ping").status_code == 200 and httpx.post(f"{base}/ping").status_code == 200


def test_embeddings_have_an_id_and_created_and_models_a_permission_list(server):
    r = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": server.model, "input": "abc"}).json()
    assert r["id"].startswith("embd-") and isinstance(r["created"], int) and r["object"] == "list"
    card = server.client.models.list().data[0].model_extra
    perm = card["permission"]
    assert len(perm) == 1 and perm[0]["object"] == "model_permission" and perm[0]["id"].startswith("modelperm-")
    assert perm[0]["allow_sampling"] and perm[0]["allow_logprobs"] and not perm[0]["allow_fine_tuning"]


def test_malformed_values_carry_openais_code(server):
    """A new user's trial found these 400s with ``code: null`` where their neighbours had OpenAI's code."""
    base = server.base_url
    for path, body, param, code in (
            ("/v1/completions", {"prompt": ""}, "prompt", "invalid_value"),
            ("/v1/completions", {"prompt": [server.engine.tokenizer.vocab_size]}, "prompt", "invalid_value"),
            ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
            ("/v1/embeddings", {"input": [server.engine.tokenizer.vocab_size]}, "input", "invalid_value"),
            # and these (an API trial, through the gateway)
            ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of", "unsupported_value"),
            ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix", "unsupported_parameter"),
            ("/v1/completions", {"prompt": "hi", "min_tokens": 5}, "min_tokens", "invalid_value"),
            ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", "invalid_value"),
            ("/v1/completions", {"prompt": "hi", "logits_processors": ["x"]}, "logits_processors",
             "unsupported_parameter")):
        r = httpx.post(base + path, json={"model": server.model, "max_tokens": 1, **body}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == (param, code), (body, err)


FRANCE = "The capital of France is"


def test_bad_words_and_allowed_token_ids_restrict_the_answer(server):
    """vLLM's ``bad_words`` and ``allowed_token_ids`` (a trial: refused as unknown through the gateway; the engine
    had refused them): the greedy answer without the banned word, streamed as whole; sampling among the allowed
    ids only, their logprobs the model's own."""
    tok = server.engine.tokenizer
    plain = complete(server, prompt=FRANCE, max_tokens=8, temperature=0).choices[0].text
    assert plain.startswith(" Paris")
    banned = complete(server, prompt=FRANCE, max_tokens=8, temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text and banned.choices[0].text != plain
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model=server.model, prompt=FRANCE, max_tokens=8, temperature=0, stream=True,
        extra_body={"bad_words": ["Paris"]}) if c.choices)
    assert streamed == banned.choices[0].text
    allowed = [tok.encode(" yes")[0], tok.encode(" no")[0]]
    for seed in (1, 2):
        r = chat(server, messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=5, seed=seed,
                 logprobs=True, top_logprobs=2, extra_body={"allowed_token_ids": allowed})
        assert r.choices[0].message.content.split() and set(r.choices[0].message.content.split()) <= {"yes", "no"}
        assert all(t.token in (" yes", " no") for t in r.choices[0].logprobs.content)


def test_return_tokens_as_token_ids_names_the_logprobs_tokens(server):
    """vLLM's ``return_tokens_as_token_ids``: every token of chat and completions logprobs (the top ones and an
    echoed prompt's too) is ``token_id:<id>``, its bytes that name's; the text and the values stay."""
    named = chat(server, messages=HI, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                 extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    plain = chat(server, messages=HI, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert named.choices[0].message.content == plain.choices[0].message.content
    ids = named.choices[0].model_extra["token_ids"]
    got = named.choices[0].logprobs.content
    assert [t.token for t in got] == [f"token_id:{i}" for i in ids]
    assert [t.logprob for t in got] == [t.logprob for t in plain.choices[0].logprobs.content]
    assert all(t.bytes == list(t.token.encode()) and all(a.token.startswith("token_id:") for a in t.top_logprobs)
               for t in got)
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": server.model, "prompt": FRANCE, "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True,
        "return_tokens_as_token_ids": True}).json()   # the echo's first token has no logprob (the SDK's type: one)
    lp = r["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"]) and len(lp["tokens"]) > 3
    assert all(all(k.startswith("token_id:") for k in top) for top in lp["top_logprobs"] if top)
    assert r["choices"][0]["text"].startswith(FRANCE)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server):
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens run (the answer and usage as for those alone;
    an echo shows them); -1 keeps what fits ``max_model_len``; above it, 0 or below -1: a 400."""
    tok = server.engine.tokenizer
    ids = tok.encode("One two three four five six seven eight " + FRANCE, add_special_tokens=True)
    cut = complete(server, prompt=ids, max_tokens=4, temperature=0, extra_body={"truncate_prompt_tokens": 6})
    alone = complete(server, prompt=ids[-6:], max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text == alone.choices[0].text
    text = "One two three four five six seven eight " + FRANCE
    echoed = complete(server, prompt=text, max_tokens=1, temperature=0, echo=True,
                      extra_body={"truncate_prompt_tokens": 5})
    assert echoed.choices[0].text.startswith(tok.decode(tok.encode(text, add_special_tokens=True)[-5:],
                                                        skip_special_tokens=False))
    assert not echoed.choices[0].text.startswith("One")
    whole = chat(server, messages=HI, max_tokens=2, temperature=0, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == chat(server, messages=HI, max_tokens=2, temperature=0).usage.prompt_tokens
    assert chat(server, messages=HI, max_tokens=2, temperature=0,
                extra_body={"truncate_prompt_tokens": 3}).usage.prompt_tokens == 3
    for value, needle in ((MAX_MODEL_LEN + 1, "is greater than max_model_len"), (0, "at least 1"),
                          (-2, "below minimum value")):
        with pytest.raises(openai.BadRequestError) as exc:
            complete(server, prompt="hi", max_tokens=2, extra_body={"truncate_prompt_tokens": value})
        assert exc.value.body["param"] == "truncate_prompt_tokens" and needle in exc.value.message, exc.value.body


def test_vllms_knobs_that_change_nothing_here_are_taken(server):
    """``length_penalty`` (beam search's; beam search is refused) and ``vllm_xargs`` (custom logits processors'
    arguments; none run here) change nothing in vLLM either without those: taken, the answer the same."""
    plain = chat(server, messages=HI, max_tokens=4, temperature=0).choices[0].message.content
    extras = {"length_penalty": 0.5, "vllm_xargs": {"k": 1, "s": "a", "l": [1, "b"]}}
    assert chat(server, messages=HI, max_tokens=4, temperature=0, extra_body=extras).choices[0].message.content \
        == plain
    with pytest.raises(openai.BadRequestError) as exc:   # vLLM's type: strings, numbers or lists of them
        chat(server, messages=HI, max_tokens=4, extra_body={"vllm_xargs": {"a": {"b": 1}}})
    assert exc.value.body["param"].startswith("vllm_xargs"), exc.value.body


def test_embeddings_take_vllms_normalize_add_special_tokens_and_truncation(server):
    """vLLM's embeddings extras (a trial: refused as unknown through the gateway): ``normalize`` false gives the
    pooled vector as it is (its direction the normalized one's), ``add_special_tokens`` false embeds the text's
    tokens alone, ``truncate_prompt_tokens`` the last N tokens; bad values a 400 naming them."""
    tok, url = server.engine.tokenizer, f"{server.base_url}/v1/embeddings"

    def embed(**body) -> list[float]:
        r = httpx.post(url, json={"model": server.model, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"]

    text = "One two three four five six seven eight " + FRANCE
    unit, raw = embed(input=text), embed(input=text, normalize=False)
    norm = sum(x * x for x in raw) ** 0.5
    assert abs(sum(x * x for x in unit) - 1) < 1e-4 and abs(norm - 1) > 1e-3
    assert max(abs(a - b / norm) for a, b in zip(unit, raw)) < 1e-5
    assert embed(input=text, add_special_tokens=False) == embed(input=tok.encode(text, add_special_tokens=False))
    ids = tok.encode(text, add_special_tokens=True)
    assert embed(input=text, truncate_prompt_tokens=5) == embed(input=ids[-5:])
    assert embed(input=ids, truncate_prompt_tokens=-1) == embed(input=ids)
    for body, param in (({"normalize": "yes"}, "normalize"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
                        ({"add_special_tokens": 1}, "add_special_tokens")):
        r = httpx.post(url, json={"model": server.model, "input": text, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_continuous_usage_says_the_cached_prompt_on_every_chunk(server):
    """vLLM's ``continuous_usage_stats``: every chunk's usage, the role chunk's too, says the prompt's cached
    tokens (an API trial's role chunk said 0 and the later ones 16: it went out before the engine's first output);
    without it the role chunk still comes first."""
    messages = [{"role": "user", "content": "Count from one to twenty, please, in words."}]
    chat(server, messages=messages, max_tokens=2, temperature=0)          # the prompt is cached now
    chunks = list(server.client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
    cached = {c.usage.prompt_tokens_details.cached_tokens for c in chunks if c.usage is not None}
    assert len(cached) == 1 and cached.pop() > 0, [c.usage for c in chunks]
    assert chunks[0].choices[0].delta.role == "assistant"
