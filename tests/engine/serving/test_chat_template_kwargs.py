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
