"""``POST /tokenize`` and ``POST /detokenize`` over an ``AsyncEngine`` (vLLM's
``entrypoints/openai/serving_tokenization.py``): a prompt (completions form) or a conversation (chat form,
rendered as ``/v1/chat/completions`` renders it: ``chat.render_chat``) to token ids, and token ids back to text.
Nothing is queued to the engine: only its tokenizer is used.
"""

from __future__ import annotations

import msgspec

from engine.protocol.errors import ServingError
from engine.serving.chat import render_chat
from engine.serving.protocol import UNSERVED_FIELDS
from engine.serving.serving import OpenAIServing, parse_body


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    """The completions form of ``POST /tokenize`` (vLLM's ``TokenizeCompletionRequest``)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of ``POST /detokenize`` (vLLM's)."""

    model: str | None = None
    tokens: list[int]


class OpenAIServingTokenization(OpenAIServing):
    """Tokenize and detokenize (constructor: ``OpenAIServing``'s)."""

    def create_tokenize(self, body: dict) -> dict:
        """``POST /tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``.

        ``body`` is the completions form (``prompt``, ``add_special_tokens``, default true) or, with
        ``messages``, the chat form: every field ``/v1/chat/completions`` reads to render its prompt
        (``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens`` default false,
        ``chat_template_kwargs``, ``tools``), rendered by the same ``render_chat``. ``return_token_strs``: the
        tokens' strings too (else ``token_strs`` is null).

        Raises:
            ServingError: 400 naming the bad field, 404 unknown model.
        """
        self.check_model(body.get("model"))
        strs = body.get("return_token_strs") is True
        if ("messages" in body) == ("prompt" in body):   # one form: a body of both would answer one silently
            raise ServingError(400, "give either 'prompt' (a text) or 'messages' (a conversation, rendered as "
                                    "/v1/chat/completions renders it)" + (", not both" if "prompt" in body else ""),
                               param="prompt", code="missing_required_parameter" if "prompt" not in body
                               else "invalid_value")
        if "messages" in body:
            rendered = render_chat(self.engine.tokenizer, body)
            if rendered.request.chat_template is not None:   # as the chat endpoint: refused, never ignored
                raise ServingError(400, f"chat_template: {UNSERVED_FIELDS['chat_template']}", param="chat_template",
                                   code="unsupported_parameter")
            ids = rendered.prompts[0][1]
        else:
            req = parse_body(body, TokenizeCompletionRequest)
            ids = self.engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": list(ids),
                "token_strs": self.engine.tokenizer.convert_ids_to_tokens(list(ids)) if strs else None}

    def create_detokenize(self, body: dict) -> dict:
        """``POST /detokenize``: ``{"prompt"}``, the text of ``tokens`` (special tokens kept, as vLLM's).

        Raises:
            ServingError: 400 naming ``tokens`` (not token ids of this model), 404 unknown model.
        """
        self.check_model(body.get("model"))
        req = parse_body(body, DetokenizeRequest)
        vocab = self.engine.tokenizer.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise ServingError(400, f"tokens[{i}]: {t} is not a token id of this model (ids are in [0, "
                                        f"{vocab}))", param="tokens", code="invalid_value")
        return {"prompt": self.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
