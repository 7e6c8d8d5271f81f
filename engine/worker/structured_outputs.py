"""Grammar-constrained decoding (structured outputs) with xgrammar.

Pieces, in the order a constrained request meets them:

1. ``StructuredOutputManager.submit(params, done)``: validation
   (``engine/worker/json_schema_subset.py``: the supported JSON-schema subset) in a
   check worker process (``engine/worker/grammar_check.py``), compile in the
   bounded pool of ``engine/worker/grammar_compiler.py`` (timeout,
   size limit, refusal cache, one memory bound on compiled grammars). The
   OpenAI layer waits for it before submitting, so the core's step loop only
   hits the cache.
2. ``add(request_id, params, stop_token_ids)``: one ``xgrammar.GrammarMatcher``
   per sequence (each of the ``n`` siblings has its own).
3. ``grammar_bitmask(rows)``: each step, the allowed-token bitmask of the
   constrained rows only (``GrammarBitmask``). The grammar owns termination
   (vLLM #42403, PR #47489): the request's ``stop_token_ids`` stop a row only
   where the grammar may end, and before that are content where the grammar
   allows them (``is_content``); ``min_tokens`` masks the grammar's end only
   while the grammar could still go on, so it never forces a token the
   grammar forbids (a row with every token masked would sample token 0).
   The sampler applies the mask with ``apply_token_bitmask`` after penalties,
   before greedy/random selection; ``min_tokens`` of constrained rows is
   applied here, not in the sampler. Unconstrained rows are not touched.
4. ``accept(request_id, token)``: the matcher advances by each token that is
   appended to the request's output (a request stop token ends the row
   without entering the grammar). ``is_terminated`` says the grammar is done
   (its stop token was accepted).

Preemption needs no rollback: a preempted request keeps its output tokens
(recompute re-prefills prompt + outputs, swap keeps the KV), so its matcher,
which has consumed exactly those tokens, stays valid. ``free(request_id)``
drops a finished or aborted sequence's matcher.

Sources: xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models"), its Python API;
vLLM v1 ``structured_output/`` for the division of work (compile once per
schema, bitmask per step, matcher per request).
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from engine.worker.grammar_compiler import Done, GrammarCompilePool, GrammarLimits
from engine.worker.json_schema_subset import check_json_schema, regex_values
from engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("tandem.structured_outputs")


@dataclass
class GrammarBitmask:
    """Allowed next tokens of a step's constrained rows.

    Attributes:
        rows: logits row indices (ascending) the masks belong to.
        bitmask: ``[len(rows), ceil(vocab / 32)]`` int32 on CPU; bit ``t % 32``
            of word ``t // 32`` is 1 when token ``t`` is allowed.
    """

    rows: list[int]
    bitmask: torch.Tensor


def apply_token_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> torch.Tensor:
    """``-inf`` on the tokens the grammar forbids, in ``mask.rows`` only.

    Out of place; pure PyTorch (no host sync, any device).

    Args:
        logits: ``[num_rows, vocab]`` float32.
        mask: the constrained rows and their bitmasks; bits beyond ``vocab``
            are ignored, logits columns beyond the bitmask are forbidden.

    Returns:
        ``[num_rows, vocab]`` float32, the other rows unchanged.
    """
    import torch  # lazy: the engine's front end imports this module (check_json_schema) and needs no torch

    device = logits.device
    vocab = logits.shape[-1]
    words = mask.bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [rows, words * 32]
    if bits.shape[1] < vocab:
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)
    allowed = bits[:, :vocab]
    idx = torch.tensor(mask.rows, dtype=torch.long, device=device)
    constrained = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, idx, constrained)


class StructuredOutputManager:
    """Compiled grammars (the bounded pool and cache) and the live sequences' matchers.

    Thread safety: ``submit``/``compile`` may run in any thread;
    ``add``/``grammar_bitmask``/``accept``/``free`` belong to the engine
    thread.

    Args:
        tokenizer: the engine's ``engine.tokenizer.Tokenizer`` (byte-level
            BPE); its vocabulary and EOS id build xgrammar's tokenizer info,
            nothing is downloaded.
        vocab_size: the model's logits width (may exceed the tokenizer's
            vocabulary; the extra ids are never allowed).
        limits: the compile pool's bounds (``GrammarLimits``).
    """

    def __init__(self, tokenizer, vocab_size: int, limits: GrammarLimits | None = None) -> None:
        import xgrammar as xgr  # heavy import (~4 s): only engines that load a model pay it

        self._xgr = xgr
        vocab = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
        vocab = [v if v is not None else "" for v in vocab]
        self.eos_token_id = tokenizer.eos_token_id
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.vocab_size = vocab_size
        # xgrammar's own cache is off: GrammarCache is the one bound on grammar memory. One compiler thread
        # per compile: the pool's workers are the parallelism.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.pool = GrammarCompilePool(self._compile_uncached, limits or GrammarLimits(), validate)
        self._matchers: dict[str, tuple[object, frozenset[int]]] = {}
        self._stops_as_content: set[str] = set()  # rows of this step whose stop tokens are grammar content

    @property
    def compile_seconds(self) -> deque[float]:
        """Wall time of the latest compiles (up to ``grammar_compiler.COMPILE_TIMES_KEPT``), seconds."""
        return self.pool.compile_seconds

    # -------------------------------------------------------------- compiling
    def submit(self, params: StructuredOutputsParams, done: Done) -> None:
        """Validate ``params`` in a check worker process and compile it in
        the pool (call from a worker thread, never an event loop: the spec
        is hashed here); ``done(digest, error)`` with
        ``GrammarRefused`` or None (``GrammarCompilePool.submit``)."""
        self.pool.submit(params, done)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params``, compiled in this thread on a miss.

        Raises:
            GrammarRefused: the spec is invalid, unsupported or too large (the
                message names the part), or was refused before.
        """
        return self.pool.compile_now(params)

    def _compile_uncached(self, params: StructuredOutputsParams) -> tuple[object, int]:
        """(xgrammar ``CompiledGrammar``, its bytes) of a validated spec."""
        c = self._compiler
        try:
            if params.json is not None:
                text = params.json if isinstance(params.json, str) else msgspec.json.encode(params.json).decode()
                out = c.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            elif params.json_object:
                out = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif params.regex is not None:
                out = c.compile_regex(params.regex)
            elif params.choice is not None:
                out = c.compile_regex("|".join(_regex_escape(s) for s in params.choice))
            elif params.grammar is not None:
                out = c.compile_grammar(params.grammar)
            else:
                out = c.compile_structural_tag(params.structural_tag)
        except (RuntimeError, self._xgr.InvalidJSONError, self._xgr.InvalidStructuralTagError) as exc:
            message = _xgrammar_message(exc)
            named = self._name_bad_regex(params) if message.startswith("Regex") else None
            if params.grammar is not None and _LARK_RULE.search(params.grammar):
                message += ("; Lark grammars (vLLM's `?start: ...`) are not read here: write it in EBNF (GBNF), "
                            "e.g. `root ::= \"cat\" | \"dog\"`")
            raise ValueError(named or f"{params.kind}: {message}") from None
        return out, out.memory_size_bytes

    def _name_bad_regex(self, params: StructuredOutputsParams) -> str | None:
        """The message naming the first regex of a refused spec's JSON schemas (``_schemas_of``: its schema, or
        its tools' parameters) that xgrammar cannot parse, with its path (``<path>: invalid JSON schema:
        <xgrammar's message>``), or None when each parses alone. Run only when a compile failed on a regex (the
        compile names none): one small parse per regex."""
        for schema, where in _schemas_of(params):
            for path, regex in regex_values(schema, where):
                try:
                    self._xgr.Grammar.from_regex(regex)
                except RuntimeError as exc:
                    return f"{path}: invalid JSON schema: {_xgrammar_message(exc)}"
        return None

    # ---------------------------------------------------------------- matchers
    def add(self, request_id: str, params: StructuredOutputsParams, stop_token_ids=()) -> None:
        """Start a matcher for one sequence (compiles on a cache miss).

        Args:
            stop_token_ids: the request's own stop tokens: they stop the row
                only where the grammar may end (never fed to the grammar then);
                before, one the grammar allows is content.

        Raises:
            GrammarRefused: as ``compile``.
        """
        stops = frozenset(t for t in stop_token_ids if t != self.eos_token_id and 0 <= t < self.vocab_size)
        self._matchers[request_id] = (self._xgr.GrammarMatcher(self.compile(params)), stops)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def grammar_bitmask(self, requests: list) -> GrammarBitmask | None:
        """The bitmask of the rows (``requests[i]``, an ``engine.core.request.Request``,
        owns row i) that have a matcher, or None when no row does. Stop tokens
        and ``min_tokens`` are settled here (see the module doc, step 3)."""
        self._stops_as_content.clear()
        rows = [i for i, r in enumerate(requests) if r.request_id in self._matchers]
        if not rows:
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            req = requests[i]
            matcher, stops = self._matchers[req.request_id]
            matcher.fill_next_token_bitmask(bitmask, j)
            self._settle_termination(bitmask[j], req, stops)
        return GrammarBitmask(rows=rows, bitmask=bitmask)

    def _settle_termination(self, row, req, stops: frozenset[int]) -> None:
        """Edit one row's mask: the grammar's end (EOS) and the request's stop
        tokens. Host-side int32 words; bit ``t % 32`` of word ``t // 32``."""
        eos = self.eos_token_id
        may_end = eos is not None and _get_bit(row, eos)
        if not may_end and not stops:
            return
        must_end = False
        if may_end:
            _set_bit(row, eos, False)
            must_end = not bool(row.any())
            _set_bit(row, eos, True)
        early = req.num_output_tokens < req.sampling_params.min_tokens
        if may_end and early and not must_end:
            _set_bit(row, eos, False)  # min_tokens: go on while the grammar can
        if may_end and (must_end or not early):
            for t in stops:   # where the grammar may end, a stop token ends the output (a complete one)
                _set_bit(row, t, True)
        elif any(_get_bit(row, t) for t in stops):   # the grammar allows a stop token here (EOS edits leave them)
            # Before the grammar may end, a stop token the grammar allows is its content, not a stop: stopping on
            # it would cut the output, and masking it bent it (a user trial's "age": 25 could not be followed by
            # its stop token "," and ran on in digits to max_tokens). Those the grammar forbids it masks itself.
            self._stops_as_content.add(req.request_id)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance a sequence's matcher by its newly sampled token.

        Returns:
            True when the sequence must stop here: its grammar terminated, or
            (never expected, as the mask forbids it) the token was rejected.
            A request stop token returns False (the scheduler stops it),
            unless it is grammar content this step (``is_content``).
        """
        entry = self._matchers.get(request_id)
        if entry is None:
            return False
        matcher, stops = entry
        if token_id in stops and request_id not in self._stops_as_content:
            return False
        if not matcher.accept_token(token_id):
            logger.error("%s: token %d rejected by its grammar; stopping the request", request_id, token_id)
            return True
        return matcher.is_terminated()

    def is_content(self, request_id: str, token_id: int) -> bool:
        """True when ``token_id``, one of the request's stop tokens sampled this
        step, is grammar content (sampled before the grammar may end): the
        scheduler must not stop on it."""
        entry = self._matchers.get(request_id)
        return entry is not None and token_id in entry[1] and request_id in self._stops_as_content

    def free(self, request_id: str) -> None:
        """Drop a finished or aborted sequence's matcher; no-op if none."""
        self._matchers.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop the compile pool (running compiles finish in the background)."""
        self.pool.shutdown()


def validate(params: StructuredOutputsParams) -> None:
    """Refuse a spec whose JSON schemas leave the supported subset
    (``engine/worker/json_schema_subset.py``), named by ``params.where``.

    Raises:
        ValueError: ``"<where><path>: ..."``.
    """
    for schema, where in _schemas_of(params):
        check_json_schema(schema, where)


def _schemas_of(params: StructuredOutputsParams):
    """(schema, path) of each JSON schema of a spec: its ``json`` (named by ``params.where``, else "schema"), or
    each tag's of a structural tag (one path per tag in ``params.where``, else ``structural_tag.tags[i]``; none
    when the tag is not JSON: xgrammar says what is wrong).

    Raises:
        ValueError: a ``json`` spec that is not JSON.
    """
    if params.json is not None:
        try:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        except json.JSONDecodeError as exc:
            raise ValueError(f"schema: not valid JSON: {exc}") from None
        yield schema, params.where[0] if params.where else "schema"
        return
    if params.structural_tag is None:
        return
    try:
        tag = json.loads(params.structural_tag)
    except json.JSONDecodeError:
        return
    fmt = tag.get("format", {}) if isinstance(tag, dict) else {}
    for i, schema in enumerate(_format_schemas(fmt)):
        yield schema, params.where[i] if i < len(params.where) else f"structural_tag.tags[{i}]"


def _format_schemas(fmt: object):
    """The JSON schemas of a structural tag's format, in order: an ``or``'s elements (a text answer's schema,
    then the tool calls'), a ``json_schema`` element's, each tag's content."""
    if not isinstance(fmt, dict):
        return
    if fmt.get("type") == "or":
        for element in fmt.get("elements") or []:
            yield from _format_schemas(element)
    elif fmt.get("type") == "json_schema":
        yield fmt.get("json_schema")
    else:
        for t in fmt.get("tags", [fmt]):
            content = t.get("content") if isinstance(t, dict) else None
            if isinstance(content, dict) and content.get("type") == "json_schema":
                yield content.get("json_schema")


def _get_bit(row, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def _set_bit(row, token: int, value: bool) -> None:
    word = int(row[token // 32]) & 0xFFFFFFFF
    word = word | (1 << (token % 32)) if value else word & ~(1 << (token % 32))
    row[token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # back to a signed int32


def _regex_escape(text: str) -> str:
    """Escape a literal for xgrammar's regex syntax (ECMAScript-like)."""
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}/" else ch for ch in text)


# a Lark rule's head at a line's start (``?start:``, ``value :``), which EBNF writes ``name ::=``
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_]*\s*:(?!:)", re.MULTILINE)


def _xgrammar_message(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text.strip()
