"""Tokenizer: GGUF-built byte-level BPE and chat templates vs transformers."""

from __future__ import annotations

import json

import jinja2
import pytest

from engine.tokenizer import Tokenizer
from loadtests.workloads import MT_BENCH_PATH

DATA = MT_BENCH_PATH
TRICKY = [
    "", " ", "Hello world 12345 and 3.14159", " hi  there\n\n  x", "안녕하세요 세계 😀 café", "日本語のテキスト、中文。",
    "<|im_start|>user\nhi<|im_end|>\n", "x<|endoftext|>y<|im_end|>", "naïve façade — “quotes” ½ ² ³ ١٢٣ 𝟘𝟙",
    "I'm you'RE they've WE'LL", "tabs\tand\r\nCRLF\r\n", "   leading", "trailing   ", "🇫🇷👨‍👩‍👧 emoji ZWJ",
    "a1b22c333d4444 1,000,000.00", "def f(x):\n    return x**2  # comment\n", "<notatoken> <|im_start", "\u00a0nbsp\u200bzw",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 😀"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "안녕"}, {"role": "assistant", "content": "Hi"}],
]


def _prompts() -> list[str]:
    texts = []
    for line in DATA.read_text().splitlines():
        texts.extend(json.loads(line)["turns"])
    return texts + TRICKY


@pytest.fixture
def smollm2(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture
def hf_smollm2(hf_smollm2_tokenizer):
    return hf_smollm2_tokenizer


def test_metadata(smollm2):
    assert (smollm2.bos_token_id, smollm2.eos_token_id, smollm2.vocab_size) == (1, 2, 49152)
    assert smollm2.all_special_ids == set(range(17))  # the 17 control tokens of SmolLM2
    assert smollm2.add_bos_token is False
    assert smollm2.convert_ids_to_tokens([1, 2, 28120, 905]) == ["<|im_start|>", "<|im_end|>", "hello", "Ġworld"]


def test_roundtrip(smollm2):
    for text in _prompts():
        ids = smollm2.encode(text)
        assert smollm2.decode(ids, skip_special_tokens=False) == text
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_decode_keeps_special_tokens_by_default_as_transformers_does(smollm2, hf_smollm2):
    """transformers' ``decode`` and ``batch_decode`` (and so vLLM's tokenizer) keep special tokens unless told
    to skip them; a vLLM user's ``tok.decode([1, 9690, 198])`` got 'system\\n' (the default was True here)."""
    ids = [1, 9690, 198]
    assert smollm2.decode(ids) == hf_smollm2.decode(ids) == "<|im_start|>system\n"
    rows = [smollm2.encode(t) for t in TRICKY]
    assert smollm2.batch_decode(rows) == hf_smollm2.batch_decode(rows)
    assert smollm2.batch_decode([ids]) == ["<|im_start|>system\n"]


@pytest.mark.slow
def test_ids_match_transformers(smollm2, hf_smollm2):
    for text in _prompts():
        assert smollm2.encode(text) == hf_smollm2.encode(text, add_special_tokens=False), text
        assert smollm2.encode(text, add_special_tokens=True) == hf_smollm2.encode(text), text
        ids = smollm2.encode(text)
        for skip in (True, False):
            assert smollm2.decode(ids, skip_special_tokens=skip) == hf_smollm2.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_chat_template_matches_transformers(smollm2, hf_smollm2):
    for conv in CONVERSATIONS:
        for gen in (True, False):
            ours = smollm2.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours == hf_smollm2.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)


@pytest.mark.slow
def test_the_transformers_calls_a_vllm_script_makes(smollm2, hf_smollm2):
    """What a vLLM script calls on ``llm.get_tokenizer()`` (a transformers tokenizer there), as transformers
    answers it: a trial's ``apply_chat_template(msgs, tokenize=True)`` got a str (transformers: token ids, its
    default), and ``tok(text)``, ``batch_decode`` and ``pad_token_id`` were missing."""
    for conv in CONVERSATIONS:
        want = hf_smollm2.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)
        assert smollm2.apply_chat_template(conv) == want
        assert smollm2.apply_chat_template(conv, tokenize=True) == want
    texts = TRICKY[2:6]
    for text in texts:
        assert smollm2(text)["input_ids"] == hf_smollm2(text)["input_ids"]
    assert smollm2(texts) == {k: hf_smollm2(texts)[k] for k in ("input_ids", "attention_mask")}
    rows = [smollm2.encode(t) for t in TRICKY]
    for skip in (True, False):
        assert smollm2.batch_decode(rows, skip_special_tokens=skip) == hf_smollm2.batch_decode(
            rows, skip_special_tokens=skip)
    assert smollm2.pad_token_id == hf_smollm2.pad_token_id == 2


def test_hf_dir_and_template_helpers(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel(vocab={"<s>": 0, "</s>": 1, "hi": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "{{ bos_token }}{{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}{{ strftime_now('%Y') | length }}{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}))
    t = Tokenizer.from_hf_dir(str(tmp_path))
    assert (t.bos_token_id, t.eos_token_id, t.all_special_ids) == (0, 1, {0, 1})
    assert t.apply_chat_template([{"role": "user", "content": "hé"}], tokenize=False) == '<s>"hé"</s>4'
    with pytest.raises(jinja2.TemplateError, match="no tools"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])
    assert t.decode([0, 2, 1], skip_special_tokens=True) == "hi"
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(str(tmp_path))
