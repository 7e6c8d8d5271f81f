"""Incremental detokenizer: split UTF-8, stop strings across tokens, hold-back, streaming == non-streaming."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, decode_token, fill_decoded_tokens
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams

FFFD = "\ufffd"


# --------------------------------------------------------------------------
# A tiny byte-level tokenizer: each token is an arbitrary byte string (so a
# multi-byte character can be split anywhere), decoded like byte-level BPE
# (UTF-8 with U+FFFD for invalid / incomplete sequences).
class ByteTokenizer:
    EOS = 0

    def __init__(self) -> None:
        self.pieces: list[bytes] = [b"<|eos|>"]
        self.all_special_ids = {self.EOS}

    def add(self, piece: bytes) -> int:
        self.pieces.append(piece)
        return len(self.pieces) - 1

    def encode_random(self, text: str, rng: random.Random) -> list[int]:
        data = text.encode()
        ids, i = [], 0
        while i < len(data):
            n = rng.randint(1, 4)
            ids.append(self.add(data[i:i + n]))
            i += n
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[i] for i in ids
                        if not (skip_special_tokens and i in self.all_special_ids)).decode("utf-8", "replace")

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i].decode("latin-1") for i in ids]


def reference(text: str, stop: list[str], include: bool, floor: int = 0) -> tuple[str, str | None]:
    """Non-streamed result: cut at the stop string that ends first (longest on
    ties) among those ending after ``text[:floor]`` (the text of the first
    ``min_tokens`` tokens)."""
    best = None
    for s in stop:
        i = text.find(s, max(0, floor - len(s) + 1))
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s) if include else i], s


def stream(tok, prompt, ids, params, group=1, check_hold=None):
    """Feed ``ids`` in groups of ``group``; return (deltas, stop, detok)."""
    d = IncrementalDetokenizer(tok, prompt, params)
    deltas, stop = [], None
    for i in range(0, len(ids), group):
        delta, stop = d.update(ids[i:i + group])
        deltas.append(delta)
        if check_hold is not None:
            check_hold(d, ids[: i + group])
        if stop is not None:
            break
    else:
        deltas.append(d.flush())
    return deltas, stop, d


# --------------------------------------------------------------------------
# Fast tests with the byte tokenizer.

def test_split_multibyte_never_emits_replacement_char():
    tok = ByteTokenizer()
    text = "a😀b한c漢字é" * 3
    data = text.encode()
    ids = [tok.add(data[i:i + 1]) for i in range(len(data))]  # one byte per token
    deltas, stop, d = stream(tok, [], ids, SamplingParams())
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == text == d.output_text
    assert stop is None
    # 😀 is 4 bytes: its first 3 tokens produce nothing
    assert deltas[:5] == ["a", "", "", "", "😀"]


def test_flush_emits_incomplete_tail():
    tok = ByteTokenizer()
    data = "x😀".encode()
    ids = [tok.add(data[:1]), tok.add(data[1:3])]  # "x" + half an emoji
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    assert d.update(ids) == ("x", None)
    assert d.flush() == FFFD
    assert d.output_text == "x" + FFFD
    assert d.update([tok.add(b"y")]) == ("", None)  # finished


def test_stop_string_across_tokens_hold_back_and_truncation():
    tok = ByteTokenizer()
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    ids = [tok.add(c.encode()) for c in alphabet]
    params = SamplingParams(stop=["DEFGHIJ"])
    deltas, stop, d = stream(tok, [], ids, params)
    assert stop == "DEFGHIJ" and d.stop_reason == "DEFGHIJ"
    assert "".join(deltas) == "ABC" == d.output_text
    # "D" .. "DEFGHI" are held (each a prefix of the stop), never emitted
    assert deltas == ["A", "B", "C", "", "", "", "", "", "", ""]
    assert d.flush() == ""

    deltas, stop, d = stream(tok, [], ids, SamplingParams(stop=["DEFGHIJ"], include_stop_str_in_output=True))
    assert "".join(deltas) == "ABCDEFGHIJ" and stop == "DEFGHIJ"


def test_hold_back_only_what_can_start_a_stop():
    tok = ByteTokenizer()
    ids = [tok.add(c.encode()) for c in "xyzab"]
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["abc", "zzzzzz"]))
    out = [d.update([i])[0] for i in ids]
    assert out == ["x", "y", "", "z", ""]  # "z" could start "zzzzzz"; "a", "ab" could start "abc"
    assert d.flush() == "ab"
    assert d.output_text == "xyzab"


def test_first_ending_stop_wins_and_chunking_does_not_matter():
    tok = ByteTokenizer()
    ids = [tok.add(c.encode()) for c in "xxabcdefyy"]
    params = SamplingParams(stop=["abcdef", "cd"])
    for group in (1, 3, len(ids)):
        deltas, stop, d = stream(tok, [], ids, params, group=group)
        assert (d.output_text, stop) == ("xxab", "cd")


def test_stop_string_within_min_tokens_is_not_a_stop():
    tok = ByteTokenizer()
    ids = [tok.add(c.encode()) for c in ["Red", "\n", "2", ".", " Blue", "\n", "3"]]
    # The first "\n" is token 2 (<= min_tokens): kept in the text, not trimmed;
    # the second is token 6: a stop. Chunking does not matter.
    for group in (1, 2, len(ids)):
        deltas, stop, d = stream(tok, [], ids, SamplingParams(stop=["\n"], min_tokens=4), group=group)
        assert (d.output_text, stop) == ("Red\n2. Blue", "\n")
        assert "".join(deltas) == d.output_text
    # min_tokens covering every stop: no stop at all, the whole text comes out.
    deltas, stop, d = stream(tok, [], ids, SamplingParams(stop=["\n"], min_tokens=7))
    assert (stop, "".join(deltas)) == (None, "Red\n2. Blue\n3")
    # A stop that starts within min_tokens but ends after it counts.
    deltas, stop, d = stream(tok, [], ids, SamplingParams(stop=["2. B"], min_tokens=3))
    assert (d.output_text, stop) == ("Red\n", "2. B")


def test_stop_terminated_drops_eos_text_and_flushes():
    tok = ByteTokenizer()
    ids = [tok.add(b"he"), tok.add(b"ll"), tok.add(b"o")]
    params = SamplingParams(stop=["lo!"], skip_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], params)
    assert d.update(ids[:2]) == ("hel", None)  # "l" may start "lo!"
    assert d.update([ids[2], tok.EOS], stop_terminated=True) == ("lo", None)
    assert d.finished and d.flush() == ""
    assert d.output_text == "hello"  # held "lo" flushed, EOS text not added
    assert "<|eos|>" not in d.output_text


def test_skip_special_tokens():
    tok = ByteTokenizer()
    ids = [tok.add(b"a"), tok.EOS, tok.add(b"b")]
    for skip, expected in ((True, "ab"), (False, "a<|eos|>b")):
        deltas, _, d = stream(tok, [], ids, SamplingParams(skip_special_tokens=skip))
        assert "".join(deltas) == expected == d.output_text


def test_prompt_is_context_only():
    tok = ByteTokenizer()
    prompt = tok.encode_random("the prompt 😀", random.Random(0))
    ids = tok.encode_random("out", random.Random(1))
    deltas, _, d = stream(tok, prompt, ids, SamplingParams())
    assert d.output_text == "out"


def test_decode_token_helpers():
    tok = ByteTokenizer()
    t = tok.add(b" hi")
    assert decode_token(tok, t) == " hi"
    assert decode_token(tok, tok.EOS) == "<|eos|>"
    pos = {t: Logprob(-0.1, 1), tok.EOS: Logprob(-3.0, 2)}
    fill_decoded_tokens(tok, pos)
    assert [lp.decoded_token for lp in pos.values()] == [" hi", "<|eos|>"]
    fill_decoded_tokens(tok, None)


_CHARS = st.sampled_from(list("ab \n.xé한😀字"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(_CHARS, max_size=40), stops=st.lists(st.text(_CHARS, min_size=1, max_size=5), max_size=3),
       include=st.booleans(), seed=st.integers(0, 2**32 - 1), group=st.integers(1, 5),
       min_tokens=st.integers(0, 12))
def test_streaming_equals_non_streaming_byte_tokenizer(text, stops, include, seed, group, min_tokens):
    tok = ByteTokenizer()
    rng = random.Random(seed)
    prompt = tok.encode_random("prompt é", rng)
    ids = tok.encode_random(text, rng)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens)
    floor = len(tok.decode(ids[:min_tokens]).rstrip(FFFD))  # complete text of the first min_tokens tokens
    expected, expected_stop = reference(text, stops, include, floor)
    max_hold = max((len(s) for s in stops), default=1) - 1

    def check_hold(d, fed):
        if d.finished:
            return
        complete = tok.decode(fed).rstrip(FFFD)  # the text has no U+FFFD of its own
        assert len(complete) - len(d.output_text) <= max(max_hold, 0)

    for g in (1, group):
        deltas, stop, d = stream(tok, prompt, ids, params, group=g, check_hold=check_hold)
        assert all(FFFD not in x for x in deltas)
        assert "".join(deltas) == d.output_text == expected
        assert stop == expected_stop
    # all at once (non-streamed)
    d = IncrementalDetokenizer(tok, prompt, params)
    delta, stop = d.update(ids)
    final = delta + (d.flush() if stop is None else "")
    assert final == expected and stop == expected_stop


# --------------------------------------------------------------------------
# The real SmolLM2 tokenizer: transformers' (from the GGUF) and engine.tokenizer (tests/engine/conftest.py's).

class _Encoder:
    """Uniform encode(text) -> ids over both tokenizers."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module", params=["transformers", "engine"])
def real_tok(request):
    if request.param == "transformers":
        return request.getfixturevalue("hf_smollm2_tokenizer")      # tests/engine/conftest.py
    return request.getfixturevalue("smollm2_tokenizer")


@pytest.mark.slow
def test_real_multilingual_token_by_token(real_tok):
    text = "Emoji: 😀🎉👍🏽 한국어 안녕하세요 汉字漢字 日本語テキスト — naïve café ✓"
    ids = _Encoder(real_tok)(text)
    assert any(FFFD in real_tok.decode([i]) for i in ids)  # some char really is split
    prompt = _Encoder(real_tok)("Repeat: ")
    deltas, stop, d = stream(real_tok, prompt, ids, SamplingParams())
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == real_tok.decode(ids) == text


@pytest.mark.slow
def test_real_alphabet_stop_string(real_tok):
    enc = _Encoder(real_tok)
    ids = enc("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    assert all("DEFGHIJ" not in real_tok.decode([i]) for i in ids)  # the stop spans tokens
    for include, expected in ((False, "ABC"), (True, "ABCDEFGHIJ")):
        deltas, stop, d = stream(real_tok, enc("Alphabet: "), ids,
                                 SamplingParams(stop=["DEFGHIJ"], include_stop_str_in_output=include))
        assert stop == "DEFGHIJ"
        assert "".join(deltas) == expected == d.output_text
        if not include:
            assert not any(c in "".join(deltas) for c in "DEFGHIJ")
    # spaced alphabet
    ids = enc("A B C D E F G H I J K L M")
    deltas, stop, _ = stream(real_tok, [], ids, SamplingParams(stop=["D E F G H I J"]))
    assert "".join(deltas) == "A B C " and stop == "D E F G H I J"


@pytest.mark.slow
def test_real_stop_fused_inside_a_token(real_tok):
    ids = _Encoder(real_tok)("Intro:\n\n  body text")
    pieces = [real_tok.decode([i]) for i in ids]
    assert any("\n\n" in p and p != "\n\n" for p in pieces), pieces  # "\n\n" fused with spaces
    deltas, stop, d = stream(real_tok, [], ids, SamplingParams(stop=["\n\n"]))
    assert stop == "\n\n"
    assert d.output_text == "".join(deltas) == "Intro:"


@pytest.mark.slow
def test_real_skip_special_tokens(real_tok):
    enc = _Encoder(real_tok)
    eos = real_tok.eos_token_id
    ids = enc("Hi there") + [eos] + enc(" again")
    _, _, d = stream(real_tok, [], ids, SamplingParams(skip_special_tokens=True))
    assert d.output_text == "Hi there again"
    _, _, d = stream(real_tok, [], ids, SamplingParams(skip_special_tokens=False))
    assert d.output_text == real_tok.decode(ids, skip_special_tokens=False)
    assert d.output_text != "Hi there again"


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.sampled_from(list("ab \n.,é한😀字Z")), max_size=30),
       stops=st.lists(st.text(st.sampled_from(list("ab \n.é😀")), min_size=1, max_size=4), max_size=3),
       include=st.booleans())
def test_real_streaming_equals_non_streaming(real_tok, text, stops, include):
    ids = _Encoder(real_tok)(text)
    full = real_tok.decode(ids)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    expected, expected_stop = reference(full, stops, include)
    deltas, stop, d = stream(real_tok, [], ids, params)
    assert all(FFFD not in x for x in deltas)
    assert "".join(deltas) == expected and stop == expected_stop
    d = IncrementalDetokenizer(real_tok, [], params)
    delta, stop = d.update(ids)
    assert delta + (d.flush() if stop is None else "") == expected and stop == expected_stop


def test_stop_token_text_is_kept_with_include_stop_str_in_output():
    """vLLM v1: a stop token's (``stop_token_ids``, EOS) text is left out only without
    ``include_stop_str_in_output`` (a trial's SmolLM2 with stop_token_ids [30] answered " Paris", its logprobs
    [" Paris", "."]); a special token's text still follows ``skip_special_tokens``."""
    tok = ByteTokenizer()
    paris, dot = tok.add(b" Paris"), tok.add(b".")
    for include, expected in ((False, " Paris"), (True, " Paris.")):
        d = IncrementalDetokenizer(tok, [], SamplingParams(stop_token_ids=[dot], include_stop_str_in_output=include))
        assert d.update([paris, dot], stop_terminated=True) == (expected, None)
        assert d.output_text == expected and d.finished
    for skip, expected in ((True, " Paris"), (False, " Paris<|eos|>")):
        d = IncrementalDetokenizer(tok, [], SamplingParams(include_stop_str_in_output=True, skip_special_tokens=skip))
        assert d.update([paris], stop_terminated=False) == (" Paris", None)
        assert d.update([tok.EOS], stop_terminated=True) == (expected[len(" Paris"):], None)
