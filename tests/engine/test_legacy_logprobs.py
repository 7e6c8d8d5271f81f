"""Legacy completions ``logprobs`` of tokens that hold part of a character (engine/serving/logprobs.py), with the
embedded SmolLM2's byte-level BPE tokenizer: an engine trial's CJK answer had every such token named "\\ufffd" (one
``top_logprobs`` key for them all, the sampled token's logprob overwritten by another's) and ``text_offset``s
counted one character per token, running past the end of the text."""

from __future__ import annotations

from engine.outputs import Logprob
from engine.serving.logprobs import LogprobFormatter, TextCursor, empty_completion_logprobs

TEXT = "中文 🎉 café"


def test_partial_character_tokens_are_named_by_their_bytes_and_offsets_index_the_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    fmt = LogprobFormatter(tok)
    # each position: the sampled token (rank 2, so the top-1 entry is another) and two others, all partial ones
    # where the text has them
    partial = [i for i in ids if "\ufffd" in tok.decode([i], skip_special_tokens=False)]
    assert len(partial) >= 3, "the text must hold tokens that are parts of characters"
    others = [[p for p in partial if p != t][:2] for t in ids]
    positions = [{o[0]: Logprob(-0.5, 1), t: Logprob(-1.0 - 0.1 * j, 2), o[1]: Logprob(-3.0, 3)}
                 for j, (t, o) in enumerate(zip(ids, others))]
    lps = empty_completion_logprobs()
    cursor = fmt.append_completion_logprobs(lps, ids[:4], positions[:4], 2, TextCursor())
    fmt.append_completion_logprobs(lps, ids[4:], positions[4:], 2, cursor)       # a stream's next chunk
    for j, (name, lp, top) in enumerate(zip(lps["tokens"], lps["token_logprobs"], lps["top_logprobs"])):
        assert top[name] == lp == -1.0 - 0.1 * j, (j, name, top)                   # its own logprob, not another's
        assert len(top) == 2                                                   # ranks 1 and 2: two names
    assert all(n.startswith("bytes:\\x") for n, i in zip(lps["tokens"], ids) if i in partial)
    offsets = lps["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(TEXT)
    # a token that is whole characters starts where they stand in the text
    for off, name in zip(offsets, lps["tokens"]):
        if not name.startswith("bytes:"):
            assert TEXT[off:off + len(name)] == name, (off, name, offsets, lps["tokens"])
