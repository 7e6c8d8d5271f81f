"""``chat_template_kwargs`` reach the model's chat template (never ignored): ``render_chat``, the one rendering
of ``/v1/chat/completions``, ``/tokenize``'s chat form and the gateway's local backend."""

from __future__ import annotations

from engine.config import default_model_path
from engine.serving.chat import render_chat
from engine.tokenizer import Tokenizer, load_tokenizer

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}")


def test_chat_template_kwargs_are_variables_of_the_template():
    base = load_tokenizer(default_model_path())
    tok = Tokenizer(base._tok, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                    chat_template=TEMPLATE, add_bos_token=False)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    plain = render_chat(tok, body).prompts[0][1]
    off = render_chat(tok, {**body, "chat_template_kwargs": {"enable_thinking": False}}).prompts[0][1]
    assert tok.decode(plain) == "user: hi\n"
    assert tok.decode(off) == "user: hi\n/no_think\n"


def test_the_servers_own_template_arguments_are_refused_by_name():
    """``tokenize``, ``add_generation_prompt``, ``messages`` (and ``tools`` when the request has tools) are the
    server's arguments of the template: a security trial's ``{"tokenize": true}`` got a 400 naming an internal
    function ("got multiple values for keyword argument"); now one naming the field."""
    import pytest

    from engine.serving.serving import ServingError

    base = load_tokenizer(default_model_path())
    tok = Tokenizer(base._tok, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                    chat_template=TEMPLATE + "{% if tools %}tools: {{ tools | length }}\n{% endif %}",
                    add_bos_token=False)           # a template that renders tools itself
    body = {"messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for kwargs, extra in (({"tokenize": True}, {}), ({"add_generation_prompt": False}, {}),
                          ({"messages": []}, {}), ({"tools": []}, {"tools": [tool]})):
        with pytest.raises(ServingError) as e:
            render_chat(tok, {**body, **extra, "chat_template_kwargs": kwargs})
        (key,) = kwargs
        assert e.value.param == f"chat_template_kwargs.{key}" and "engine." not in e.value.message, e.value.message
    render_chat(tok, {**body, "chat_template_kwargs": {"tools": [tool]}})   # no request tools: a variable as any
