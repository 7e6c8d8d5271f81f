"""Grammar-constrained decoding (structured outputs) with xgrammar.

Pieces, in the order a constrained request meets them:

1. ``check_json_schema(schema)``: a schema is valid JSON Schema (checked
   against the 2020-12 meta-schema with ``jsonschema``) and uses no keyword
   that the grammar could not enforce (``not``, ``if``/``then``/``else``,
   ``uniqueItems``, ...): otherwise ``ValueError`` naming the offending part.
2. ``StructuredOutputManager.compile(params)``: one compiled grammar per
   distinct spec (JSON schema, json_object, regex, choice, structural tag),
   kept in an LRU cache keyed by the spec's canonical text. The OpenAI layer
   has it compiled in a worker thread of the engine core (its process or its
   thread) before submitting, so the core's step loop only hits the cache.
3. ``add(request)``: one ``xgrammar.GrammarMatcher`` per sequence (each of
   the ``n`` siblings has its own).
4. ``grammar_bitmask(rows)``: each step, the allowed-token bitmask of the
   constrained rows only (``GrammarBitmask``); the sampler applies it with
   ``apply_token_bitmask`` after penalties and ``min_tokens``, before
   greedy/random selection. Unconstrained rows are not touched.
5. ``accept(request_id, token)``: the matcher advances by each token that is
   appended to the request's output. ``is_terminated`` says the grammar is
   done (its stop token was accepted).

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
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("tandem.structured_outputs")

_CACHE_SIZE = 256  # compiled grammars kept (LRU)
# Keywords whose constraint xgrammar would silently drop (probed against
# xgrammar 0.2): a grammar cannot enforce them, so such schemas are refused.
_UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "uniqueItems",
                         "minContains", "maxContains")


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


def check_json_schema(schema: object, where: str = "schema") -> None:
    """Refuse a JSON schema that is invalid or uses an unenforceable keyword.

    Args:
        schema: the decoded schema (an object or a boolean).
        where: the path to name in messages (e.g.
            ``response_format.json_schema.schema``).

    Raises:
        ValueError: ``"<where>.<path>: <problem>"`` for an invalid schema, or
            ``"<where>.<path>: unsupported schema feature '<keyword>'"``.
    """
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{where}: must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        raise ValueError(f"{where}{path}: invalid JSON schema: {exc.message}") from None
    _check_keywords(schema, where)


def _check_keywords(node: object, path: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_keywords(item, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    for key in _UNSUPPORTED_KEYWORDS:
        if key in node and not (key == "uniqueItems" and node[key] is False):
            raise ValueError(f"{path}: unsupported schema feature '{key}' (a grammar cannot enforce it)")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise ValueError(f"{path}: unsupported schema feature 'allOf' with more than one schema")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"{path}.$ref: unsupported schema feature: remote reference {ref!r}")
    if "multipleOf" in node and node.get("type") != "integer":
        raise ValueError(f"{path}: unsupported schema feature 'multipleOf' on a non-integer")
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):
            continue  # values, not schemas
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            if isinstance(value, dict):
                for name, sub in value.items():
                    _check_keywords(sub, f"{path}.{key}.{name}")
        elif isinstance(value, (dict, list)):
            _check_keywords(value, f"{path}.{key}")


class StructuredOutputManager:
    """Compiled grammars (cached by spec) and the live sequences' matchers.

    Thread safety: ``compile`` may run in any thread (the cache is locked);
    ``add``/``grammar_bitmask``/``accept``/``free`` belong to the engine
    thread.

    Args:
        tokenizer: the engine's ``engine.tokenizer.Tokenizer`` (byte-level
            BPE); its vocabulary and EOS id build xgrammar's tokenizer info,
            nothing is downloaded.
        vocab_size: the model's logits width (may exceed the tokenizer's
            vocabulary; the extra ids are never allowed).
        max_threads: xgrammar compile threads.

    Attributes:
        compile_seconds: wall time of every cache-missing compile, seconds.
    """

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 2) -> None:
        import xgrammar as xgr  # heavy import (~4 s): only engines that load a model pay it

        self._xgr = xgr
        vocab = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
        vocab = [v if v is not None else "" for v in vocab]
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self._matchers: dict[str, object] = {}
        self.compile_seconds: list[float] = []

    # -------------------------------------------------------------- compiling
    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (from the cache when seen before).

        Raises:
            ValueError: the spec is invalid or uses an unsupported feature;
                the message names the part at fault.
        """
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        start = time.perf_counter()
        compiled = self._compile_uncached(params)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.compile_seconds.append(elapsed)
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, params: StructuredOutputsParams):
        c = self._compiler
        try:
            if params.json is not None:
                schema = json.loads(params.json) if isinstance(params.json, str) else params.json
                check_json_schema(schema)
                return c.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
            if params.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if params.regex is not None:
                return c.compile_regex(params.regex)
            if params.choice is not None:
                return c.compile_regex("|".join(_regex_escape(s) for s in params.choice))
            return c.compile_structural_tag(params.structural_tag)
        except json.JSONDecodeError as exc:
            raise ValueError(f"schema: not valid JSON: {exc}") from None
        except (RuntimeError, self._xgr.InvalidJSONError, self._xgr.InvalidStructuralTagError) as exc:
            raise ValueError(f"{params.kind}: {_xgrammar_message(exc)}") from None

    # ---------------------------------------------------------------- matchers
    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start a matcher for one sequence (compiles on a cache miss).

        Raises:
            ValueError: as ``compile``.
        """
        self._matchers[request_id] = self._xgr.GrammarMatcher(self.compile(params))

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def grammar_bitmask(self, request_ids: list[str]) -> GrammarBitmask | None:
        """The bitmask of the rows (``request_ids[i]`` owns row i) that have a
        matcher, or None when no row does."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            self._matchers[request_ids[i]].fill_next_token_bitmask(bitmask, j)
        return GrammarBitmask(rows=rows, bitmask=bitmask)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance a sequence's matcher by its newly sampled token.

        Returns:
            True when the sequence must stop here: its grammar terminated, or
            (never expected, as the mask forbids it) the token was rejected.
        """
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            logger.error("%s: token %d rejected by its grammar; stopping the request", request_id, token_id)
            return True
        return matcher.is_terminated()

    def free(self, request_id: str) -> None:
        """Drop a finished or aborted sequence's matcher; no-op if none."""
        self._matchers.pop(request_id, None)


def _regex_escape(text: str) -> str:
    """Escape a literal for xgrammar's regex syntax (ECMAScript-like)."""
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}/" else ch for ch in text)


def _xgrammar_message(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text.strip()
