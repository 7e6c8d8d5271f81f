"""Incremental detokenization with stop strings.

Decoding (vLLM's ``prefix_offset`` / ``read_offset`` scheme): the new text of
a step is ``decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])``,
where ``ids`` is a few prompt tokens of context followed by the output tokens.
When that text ends in U+FFFD, the last tokens hold an incomplete UTF-8
sequence (byte-level BPE splits multi-byte characters across tokens): only
the complete characters before it are taken and the offsets stay, so the
character is decoded whole once its last byte arrives. ``flush`` takes
whatever remains, complete or not. Tokens are decoded one at a time (two
``decode`` calls of a few tokens each per token).

Stop strings: the decoded text is searched for the stop string that ENDS
first (ties: the longest), which makes the result independent of how tokens
are grouped into ``update`` calls. With ``min_tokens`` (vLLM's semantics), a
stop string that is complete within the text of the first ``min_tokens``
tokens is not a stop: it stays in the text, untrimmed, and only occurrences
that end after that text count (one that starts inside it and ends later
does). Text that could still be the beginning of
a stop string (the longest suffix that is a proper prefix of some stop, so at
most ``len(longest stop) - 1`` characters) is held back. On a match the text
is cut before the stop string (after it with ``include_stop_str_in_output``);
no character of a matched stop string is ever emitted otherwise. The same
flag puts the text of a stop token (EOS, ``stop_token_ids``) in the output, as
vLLM v1 does; without it that token's text is left out.

Invariant: the concatenation of every delta returned by ``update`` and
``flush`` equals ``output_text``, whatever the chunking of tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

from engine.grammar_end import may_end
from engine.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): some tokenizers (SentencePiece)
# drop a leading space when a token is decoded at the start of a text.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text deltas, step by step.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...) -> str``
            (``engine.tokenizer.Tokenizer``, a Hugging Face tokenizer).
        prompt_token_ids: the prompt (its last few tokens give decoding
            context; they are never part of the output).
        params: ``stop``, ``include_stop_str_in_output``, ``min_tokens``
            and ``skip_special_tokens`` are used.

    Attributes:
        output_text: everything emitted so far (the final text once finished).
        stop_reason: the matched stop string, or None.
        finished: True after a stop string matched or ``flush`` was called;
            later ``update`` calls return ``("", None)``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.stop: list[str] = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        self.min_tokens = params.min_tokens
        # A constrained answer's stop strings count only where its grammar may end (engine/grammar_end.py).
        self._may_end = may_end(params.structured_outputs) if self.stop else None   # read only at a stop string
        self._num_tokens = 0  # output tokens decoded so far
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._decoded = ""  # every complete character decoded so far (output only)
        self._partial = 0  # characters of ids[read_offset:] already in _decoded
        self._searched = 0  # self._decoded[:_searched] holds no stop string (or is within min_tokens)
        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> tuple[str, str | None]:
        """Add sampled tokens; return ``(delta, matched stop string or None)``.

        Args:
            new_token_ids: tokens generated since the previous call.
            stop_terminated: the last of ``new_token_ids`` is an EOS or a
                ``stop_token_ids`` token that finished the request: it is put in
                the text only with ``include_stop_str_in_output`` (vLLM v1's
                detokenizer; a special token's text still follows
                ``skip_special_tokens``), and the held-back text is flushed (the
                returned delta includes it).

        Returns:
            The text safe to emit now, and the stop string when one matched
            (the caller then finishes the request with ``stop_reason`` = it).
        """
        if self.finished:
            return "", None
        ids = list(new_token_ids[:-1] if stop_terminated and not self.include_stop else new_token_ids)
        for token_id in ids:  # one at a time: complete text before a split char is not held
            self._ids.append(token_id)
            self._decode(final=False)
            self._num_tokens += 1
            if self._num_tokens <= self.min_tokens:  # a stop string ending here does not count
                self._searched = len(self._decoded)
        delta, stop = self._advance(final=False)
        if stop_terminated and stop is None:
            delta += self.flush()
        return delta, stop

    def flush(self) -> str:
        """Finish: decode what is left (even an incomplete character) and
        return the held-back text. Call once when the request finished for a
        reason other than a stop string (EOS, stop token, length, abort)."""
        if self.finished:
            return ""
        self._decode(final=True)
        delta, _ = self._advance(final=True)
        self.finished = True
        return delta

    def _decode(self, final: bool) -> None:
        """Move newly complete characters from the token ids into ``_decoded``.

        Text of the unread tokens (``ids[read_offset:]``) that ends in U+FFFD
        (an incomplete UTF-8 sequence) is taken only up to that sequence;
        ``_partial`` counts the characters already taken from it, and the
        offsets move once the text ends on a complete character."""
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset],
                                            skip_special_tokens=self.skip_special_tokens)
        text = self.tokenizer.decode(self._ids[self._prefix_offset:],
                                     skip_special_tokens=self.skip_special_tokens)
        new_text = text[len(prefix_text):]
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            complete = new_text.rstrip(_REPLACEMENT_CHAR)  # wait for the last byte
            if len(complete) > self._partial:
                self._decoded += complete[self._partial:]
                self._partial = len(complete)
            return
        self._decoded += new_text[self._partial:]
        self._partial = 0
        if new_text:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def _advance(self, final: bool) -> tuple[str, str | None]:
        """Search the decoded text for stop strings and emit what is safe."""
        end = len(self._decoded)
        match = self._find_stop()
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include_stop else start
            self._decoded = self._decoded[:end]
            self.stop_reason = stop
            self.finished = True
        elif not final:
            end -= self._hold_back()
        end = max(end, len(self.output_text))
        delta = self._decoded[len(self.output_text):end]
        self.output_text += delta
        return delta, (self.stop_reason if match is not None else None)

    def _find_stop(self) -> tuple[int, str] | None:
        """(start index, stop) of the stop string ending first in the
        not-yet-searched part of the decoded text (ties: the longest)."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        text = self._decoded
        for stop in self.stop:
            i = text.find(stop, max(0, self._searched - len(stop) + 1))
            while i >= 0 and self._may_end is not None and not self._may_end(text[:i]):
                i = text.find(stop, i + 1)   # content of a constrained answer here: look further
            if i >= 0:
                cand = (i + len(stop), -len(stop), stop)
                if best is None or cand < best:
                    best = cand
        self._searched = len(text)
        if best is None:
            return None
        return best[0] + best[1], best[2]

    def _hold_back(self) -> int:
        """Length of the longest suffix of the decoded text that is a proper
        prefix of some stop string (<= len(longest stop) - 1)."""
        text = self._decoded
        hold = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:n]):
                    hold = n
                    break
        return hold


class NoDetokenizer:
    """The detokenizer of a request with ``detokenize=False`` (vLLM's base ``IncrementalDetokenizer``): its
    outputs carry token ids and no text. Stop strings need text: ``SamplingParams`` refuses them with it."""

    output_text = ""
    stop_reason: str | None = None
    finished = False

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> tuple[str, str | None]:
        """No text, no stop string: ``("", None)``."""
        return "", None

    def flush(self) -> str:
        """No text: ""."""
        return ""


def detokenizer_for(tokenizer: Any, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> IncrementalDetokenizer | NoDetokenizer:
    """A choice's detokenizer: an ``IncrementalDetokenizer``, or with ``params.detokenize`` False a
    ``NoDetokenizer`` (no tokenizer call at all)."""
    if not params.detokenize:
        return NoDetokenizer()
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)


def decode_token(tokenizer: Any, token_id: int) -> str:
    """Text of one token for ``Logprob.decoded_token`` (special tokens kept;
    a token holding part of a multi-byte character renders as U+FFFD)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def fill_decoded_tokens(tokenizer: Any, logprobs: dict | None) -> None:
    """Set ``decoded_token`` of every ``Logprob`` in one position's
    ``{token_id: Logprob}`` (in place); None logprobs, or no tokenizer (``detokenize=False``), is a no-op."""
    if not logprobs or tokenizer is None:
        return
    for token_id, lp in logprobs.items():
        lp.decoded_token = decode_token(tokenizer, token_id)
