"""A minimal, fast OpenAI-compatible upstream with canned answers (aiohttp).

The baseline target of the gateway-overhead scenario, and the upstream that
the canary, failover and parity scenarios put behind the gateway. It does no
inference: every answer is ``n`` words from a fixed cycle, where ``n`` is the
request's ``max_tokens`` (default ``--output-tokens``); non-streamed bodies
are pre-encoded and cached per (endpoint, n), so a request costs a JSON
decode and a socket write.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (stream or
not, ``stream_options.include_usage``, ``logprobs``/``top_logprobs``),
``GET /v1/models``, ``GET /health``, ``GET /stats`` (requests served).
Every response carries ``x-upstream-name``. A request with the header
``x-usage: none`` gets no ``usage`` at all (an upstream that never counts:
the ledger scenario's usage-less traffic).

Run: ``python -m loadtests.upstream --port 9001 [--name a] [--itl 0.01]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import msgspec
from aiohttp import web

WORDS = [" alpha", " beta", " gamma", " delta", " epsilon", " zeta", " eta", " theta"]
_TOP = [" alpha", " beta", " gamma", " delta", " epsilon"]


@dataclass
class UpstreamConfig:
    """Behaviour of the fake upstream.

    Attributes:
        name: reported in ``x-upstream-name`` and as the response ``model``
            when the request names none.
        output_tokens: answer length when the request has no ``max_tokens``.
        ttft: seconds to wait before the first token (streamed) or the answer.
        itl: seconds between streamed tokens.
        logprob_shift: added to the 2nd..5th top logprobs (a parity-test
            perturbation; 0 = identical to any other upstream).
        diverge_at: token position from which the answer differs from the
            default cycle (-1 = never; a parity-test perturbation).
    """

    name: str = "upstream"
    output_tokens: int = 16
    ttft: float = 0.0
    itl: float = 0.0
    logprob_shift: float = 0.0
    diverge_at: int = -1


def prompt_words(messages: list) -> int:
    """The ``prompt_tokens`` this upstream reports for chat ``messages``: their contents' words (split on
    whitespace)."""
    return sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))


def _token(cfg: UpstreamConfig, k: int) -> str:
    if 0 <= cfg.diverge_at <= k:
        return WORDS[(k + 3) % len(WORDS)]
    return WORDS[k % len(WORDS)]


def _top_logprobs(cfg: UpstreamConfig, k: int, chosen: str, n: int) -> dict[str, float]:
    base = [-0.1 - 0.01 * (k % 5), -2.5, -3.0, -3.5, -4.0]
    names = [chosen] + [t for t in _TOP if t != chosen][:4]
    vals = [base[0]] + [v + cfg.logprob_shift * (1 + (k + j) % 3) for j, v in enumerate(base[1:])]
    return dict(list(zip(names, vals))[:max(1, n)])


class Upstream:
    """Request handlers and the response cache of one fake upstream."""

    def __init__(self, cfg: UpstreamConfig):
        self.cfg = cfg
        self.requests = 0
        self._cache: dict[tuple, bytes] = {}
        self._enc = msgspec.json.Encoder()

    # --- bodies -------------------------------------------------------
    def _logprobs(self, chat: bool, tokens: list[str], top: int) -> dict:
        if chat:
            return {"content": [{"token": t, "logprob": lp[t], "bytes": list(t.encode()),
                                 "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())}
                                                  for a, b in lp.items()]}
                                for t, lp in ((t, _top_logprobs(self.cfg, k, t, top)) for k, t in enumerate(tokens))]}
        tops = [_top_logprobs(self.cfg, k, t, top) for k, t in enumerate(tokens)]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [tp[t] for t, tp in zip(tokens, tops)],
                "top_logprobs": tops, "text_offset": offsets}

    def full_body(self, chat: bool, model: str, n: int, prompt_tokens: int, top: int | None) -> bytes:
        key = (chat, model, n, prompt_tokens, top)
        body = self._cache.get(key)
        if body is not None:
            return body
        tokens = [_token(self.cfg, k) for k in range(n)]
        text = "".join(tokens)
        choice: dict = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if top is not None:
            choice["logprobs"] = self._logprobs(chat, tokens, top)
        obj = {"id": f"cmpl-{self.cfg.name}", "object": "chat.completion" if chat else "text_completion",
               "created": int(time.time()), "model": model, "choices": [choice],
               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}}
        body = self._enc.encode(obj)
        if len(self._cache) < 4096:
            self._cache[key] = body
        return body

    def stream_chunks(self, chat: bool, model: str, n: int, prompt_tokens: int, usage: bool,
                      top: int | None) -> list[bytes]:
        obj_name = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        out = []

        def chunk(choices: list, extra: dict | None = None) -> bytes:
            obj = {"id": f"cmpl-{self.cfg.name}", "object": obj_name, "created": created, "model": model,
                   "choices": choices}
            if extra:
                obj.update(extra)
            return b"data: " + self._enc.encode(obj) + b"\n\n"

        if chat:
            out.append(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
        for k in range(n):
            t = _token(self.cfg, k)
            last = k == n - 1
            c: dict = {"index": 0, "finish_reason": "length" if last else None, "logprobs": None}
            if chat:
                c["delta"] = {"content": t}
            else:
                c["text"] = t
            if top is not None:
                lp = self._logprobs(chat, [t], top)
                if not chat:
                    lp["top_logprobs"] = [_top_logprobs(self.cfg, k, t, top)]
                    lp["token_logprobs"] = [lp["top_logprobs"][0][t]]
                c["logprobs"] = lp
            out.append(chunk([c]))
        if usage:
            out.append(chunk([], {"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                            "total_tokens": prompt_tokens + n}}))
        out.append(b"data: [DONE]\n\n")
        return out

    # --- handlers -----------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = msgspec.json.decode(await request.read())
            if not isinstance(body, dict):
                raise ValueError("body must be an object")
        except (msgspec.DecodeError, ValueError) as e:
            return _error(400, f"invalid JSON body: {e}", "body")
        self.requests += 1
        model = body.get("model") or self.cfg.name
        n = body.get("max_tokens") or body.get("max_completion_tokens") or self.cfg.output_tokens
        if not isinstance(n, int) or n < 1:
            return _error(400, "max_tokens must be a positive integer", "max_tokens")
        if chat:
            msgs = body.get("messages") or []
            prompt_tokens = prompt_words(msgs)
            top = body.get("top_logprobs", 0) if body.get("logprobs") else None
        else:
            prompt_tokens = len(str(body.get("prompt", "")).split())
            top = body.get("logprobs")
        headers = {"x-upstream-name": self.cfg.name}
        if self.cfg.ttft:
            await asyncio.sleep(self.cfg.ttft)
        counts = request.headers.get("x-usage") != "none"
        if not body.get("stream"):
            if self.cfg.itl:
                await asyncio.sleep(self.cfg.itl * (n - 1))
            full = self.full_body(chat, model, n, prompt_tokens, top)
            if not counts:
                full = msgspec.json.encode({k: v for k, v in msgspec.json.decode(full).items() if k != "usage"})
            return web.Response(body=full, headers=headers, content_type="application/json")
        usage = counts and bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = self.stream_chunks(chat, model, n, prompt_tokens, usage, top)
        resp = web.StreamResponse(headers={**headers, "content-type": "text/event-stream",
                                           "cache-control": "no-cache"})
        await resp.prepare(request)
        try:
            for i, c in enumerate(chunks):
                if self.cfg.itl and 0 < i < len(chunks) - 1:
                    await asyncio.sleep(self.cfg.itl)
                await resp.write(c)
            await resp.write_eof()
        except ConnectionResetError:    # the client (the gateway, for a client that left) closed the stream
            pass
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.cfg.name, "object": "model",
                                                              "owned_by": "loadtests"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"name": self.cfg.name, "requests": self.requests})


def _error(status: int, message: str, param: str | None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                        "code": None}}, status=status)


def make_app(cfg: UpstreamConfig) -> web.Application:
    """The aiohttp application of a fake upstream."""
    up = Upstream(cfg)
    app = web.Application(client_max_size=8 * 2**20)
    app.router.add_post("/v1/chat/completions", up.completions)
    app.router.add_post("/v1/completions", up.completions)
    app.router.add_get("/v1/models", up.models)
    app.router.add_get("/health", up.health)
    app.router.add_get("/stats", up.stats)
    app["upstream"] = up
    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The upstream's command-line options."""
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=9001, help="TCP port")
    p.add_argument("--name", default="upstream", help="x-upstream-name and default model name")
    p.add_argument("--output-tokens", type=int, default=16, help="answer length without max_tokens, tokens")
    p.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    p.add_argument("--itl", type=float, default=0.0, help="seconds between streamed tokens")
    p.add_argument("--logprob-shift", type=float, default=0.0, help="added to the top logprobs, nats (parity tests)")
    p.add_argument("--diverge-at", type=int, default=-1,
                   help="answer differs from this token index on; -1: never (parity tests)")


def serve(args: argparse.Namespace) -> int:
    """Serve until killed (uvloop when installed)."""
    cfg = UpstreamConfig(args.name, args.output_tokens, args.ttft, args.itl, args.logprob_shift, args.diverge_at)
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    web.run_app(make_app(cfg), host=args.host, port=args.port, access_log=None, print=None, loop=loop,
                handle_signals=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.upstream", description=__doc__.splitlines()[0])
    add_arguments(p)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
