"""Cache keys: the key space changes with every component of the engine's numerics identity (its
``system_fingerprint``) and with the model's weights; the key with every output-changing field, never with the
fields that cannot change the tokens."""

from __future__ import annotations

from engine.fingerprint import system_fingerprint
from gateway.cache.key import cache_key, exact_space

NUMERICS = {"device": "cpu", "dtype": "torch.bfloat16", "quantization": None, "attention_backend": "cpu",
            "batch_invariant": True, "load_format": "auto", "torch": "2.9.0"}
OTHER = {"device": "cuda", "dtype": "torch.float32", "quantization": "int4", "attention_backend": "triton",
         "batch_invariant": False, "load_format": "gguf", "torch": "2.10.0"}


def test_key_space_changes_with_each_numerics_component_and_the_weights(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights-a")
    spaces = {exact_space("r", system_fingerprint(str(model), NUMERICS))}
    for name, value in OTHER.items():
        spaces.add(exact_space("r", system_fingerprint(str(model), {**NUMERICS, name: value})))
    model.write_bytes(b"weights-b")
    spaces.add(exact_space("r", system_fingerprint(str(model), NUMERICS)))
    assert len(spaces) == len(OTHER) + 2


def test_key_covers_output_changing_fields_only():
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "seed": 1, "top_logprobs": 2}
    key = cache_key("chat/completions", "m", False, body, [[1, 2, 3]])
    changed = [{**body, "seed": 2}, {**body, "temperature": 0.8}, {**body, "top_p": 0.9}, {**body, "n": 2},
               {**body, "stop": ["x"]}, {**body, "logprobs": True}, {**body, "max_tokens": 5}]
    assert len({key} | {cache_key("chat/completions", "m", False, b, [[1, 2, 3]]) for b in changed}) == 8
    assert key != cache_key("chat/completions", "m", False, body, [[1, 2, 4]])      # another rendering
    assert key != cache_key("chat/completions", "m", True, body, [[1, 2, 3]])       # stream
    assert key != cache_key("chat/completions", "m2", False, body, [[1, 2, 3]])     # another public model
    same = {**body, "user": "u", "metadata": {"a": "b"}, "stream_options": {"include_usage": True}, "model": "x"}
    assert key == cache_key("chat/completions", "m", False, same, [[1, 2, 3]])


def test_a_spot_check_compares_tool_calls_by_name_and_arguments_not_their_ids():
    """A trial's exact hit on a tool-call answer was found a mismatch (the call ids are drawn anew for each answer)
    and switched the route's cache off for every tenant. The calls are compared by index, name and arguments,
    streamed pieces assembled; another name or argument still differs."""
    from gateway.cache.key import tokens_of

    def whole(call_id: str, args: str = '{"city": "Paris"}') -> list[dict]:
        return [{"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]}}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 9}}]

    def streamed(call_id: str) -> list[dict]:
        pieces = [{"index": 0, "id": call_id, "type": "function", "function": {"name": "get_", "arguments": ""}},
                  {"index": 0, "function": {"name": "weather", "arguments": '{"city": '}},
                  {"index": 0, "function": {"arguments": '"Paris"}'}}]
        return [{"choices": [{"index": 0, "delta": {"tool_calls": [p]}, "finish_reason": None}]} for p in pieces] + [
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}]

    assert tokens_of(whole("call_1")) == tokens_of(whole("call_2")) == tokens_of(streamed("call_3"))
    assert tokens_of(whole("call_1")) != tokens_of(whole("call_1", '{"city": "Lyon"}'))
