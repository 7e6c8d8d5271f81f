"""Tokenizer: a `tokenizers` byte-level BPE built from a GGUF file or a HF
``tokenizer.json``, plus the model's jinja2 chat template.

GGUF files carry no ``tokenizer.json``: the vocabulary (``tokenizer.ggml.tokens``),
merges (``tokenizer.ggml.merges``), token types and the name of llama.cpp's
pre-tokenizer (``tokenizer.ggml.pre``) are metadata. We rebuild the same
tokenizer transformers builds for such a file (token ids are checked against
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` in the tests).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp pre-tokenizer names -> split regex (llama.cpp's llama-vocab.cpp and
# the models' own tokenizer.json files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_CONTROL = 3  # llama.cpp token type of control tokens (<|im_start|>, <|endoftext|>...)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (Radford et al. 2019)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _pre_tokenizer(pre: str | None):
    """The pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` name.

    Unknown names (and "smollm", "gpt2", "default") use GPT-2's regex inside
    ByteLevel, which is what transformers does for them; SmolLM2's vocabulary
    has no multi-digit tokens, so digits still come out one per token.
    """
    split = _SPLITS.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does: a sandboxed,
    immutable jinja2 environment with ``trim_blocks``/``lstrip_blocks``,
    loop controls, ``tojson``, ``raise_exception`` and ``strftime_now``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids, and chat-template rendering.

    Attributes:
        bos_token_id, eos_token_id, pad_token_id: special ids (None when the model has none).
        bos_token, eos_token: their strings ("" when absent), for templates.
        vocab_size: number of token ids (including added tokens).
        all_special_ids: ids of special (control) tokens, skipped by
            ``decode(skip_special_tokens=True)``.
        chat_template: jinja2 source, or None.
        add_bos_token: whether ``encode(add_special_tokens=True)`` prepends BOS.
    """

    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None, add_bos_token: bool, pad_token_id: int | None = None) -> None:
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.bos_token = tok.id_to_token(bos_token_id) if bos_token_id is not None else ""
        self.eos_token = tok.id_to_token(eos_token_id) if eos_token_id is not None else ""
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self._template = _compile_template(chat_template) if chat_template else None

    def with_chat_template(self, source: str) -> "Tokenizer":
        """This tokenizer rendering ``source`` (jinja2) instead of the model's chat template, compiled as the
        model's is (vLLM's ``LLM.chat(chat_template=...)``); the encoder itself is shared.

        Raises:
            ValueError: ``source`` is not a valid template."""
        compiled = compile_chat_template(source)
        view = copy.copy(self)
        view.chat_template, view._template = source, compiled
        return view

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_gguf(cls, path: str, reader=None) -> "Tokenizer":
        """Build from a GGUF file's ``tokenizer.*`` metadata (byte-level BPE, "gpt2" model).

        Raises:
            ValueError: the file holds no tokenizer or a non-BPE one.
        """
        from engine.gguf_file import open_gguf

        if reader is None:
            reader = open_gguf(path)
        fields = reader.fields

        def get(key, default=None):
            f = fields.get(key)
            return f.contents() if f is not None else default

        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported")
        tokens = get("tokenizer.ggml.tokens")
        merges = get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, t in enumerate(tokens):
            if not set(t) <= alphabet:
                t = "".join(spelling[b] for b in t.encode("utf-8"))
            vocab.setdefault(t, i)
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _pre_tokenizer(get("tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
        tok.add_special_tokens(special)
        bos = get("tokenizer.ggml.bos_token_id")
        eos = get("tokenizer.ggml.eos_token_id")
        add_bos = bool(get("tokenizer.ggml.add_bos_token", False))
        if add_bos and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], int(bos))])
        pad = get("tokenizer.ggml.padding_token_id")
        return cls(tok, bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
                   chat_template=get("tokenizer.chat_template"), add_bos_token=add_bos,
                   pad_token_id=None if pad is None else int(pad))

    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        """Build from a HF directory's ``tokenizer.json`` (+ ``tokenizer_config.json``
        for the chat template and BOS/EOS, + ``chat_template.jinja`` if present).

        Raises:
            FileNotFoundError: no ``tokenizer.json``.
            ValueError: a ``tokenizer.json`` the tokenizers library cannot read (named, with its reason).
        """
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{tj}: no such file (a HF model directory needs tokenizer.json)")
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise ValueError(f"{tj}: not a tokenizer the tokenizers library reads ({e})") from None
        cfg = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        model_cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}

        def token_id(name: str) -> int | None:
            t = cfg.get(name)
            if isinstance(t, dict):
                t = t.get("content")
            if t is not None:
                return tok.token_to_id(t)
            v = model_cfg.get(f"{name}_id")
            return v[0] if isinstance(v, list) and v else v

        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        return cls(tok, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   chat_template=template, add_bos_token=bool(cfg.get("add_bos_token", False)),
                   pad_token_id=token_id("pad_token"))

    # -------------------------------------------------------------- encoding
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text (e.g.
        ``<|im_start|>``) map to their ids. ``add_special_tokens`` adds BOS
        when the model asks for it (``add_bos_token``).

        Through ``encode_batch``: unlike ``encode`` it releases the GIL while it runs (a 4 MB prompt takes
        seconds), so a worker thread that tokenizes never stalls the event loop; same ids, same cost."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict:
        """transformers' ``tokenizer(text)``: ``{"input_ids": ids, "attention_mask": ones}`` for one text, or
        one list of each per text of a list (``add_special_tokens`` as in ``encode``; transformers' default
        True)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        rows = [e.ids for e in self._tok.encode_batch(list(text), add_special_tokens=add_special_tokens)]
        return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a split multi-byte char) becomes U+FFFD. Special tokens are kept
        unless ``skip_special_tokens`` (transformers' default, False, so vLLM's ``get_tokenizer()`` reads alike)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        """transformers' ``batch_decode``: ``decode`` of each token-id list (``skip_special_tokens``: transformers'
        default, False, as ``decode``'s)."""
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings (byte-level spelling, e.g. "Ġthe") of ``ids``."""
        return [self._tok.id_to_token(int(i)) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True,
                            **kw) -> str | list[int]:
        """Render ``messages`` ([{"role", "content"}, ...]) with the model's
        chat template, as transformers' ``apply_chat_template``: the text with ``tokenize=False``, its token ids
        (``encode`` without special tokens: the template writes them) with ``tokenize=True``, transformers'
        default.

        Raises:
            ValueError: the model has no chat template.
            jinja2.TemplateError: the template rejected the conversation.
        """
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context.update(kw)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        return self.encode(text) if tokenize else text


def load_chat_template(value: str | None) -> str | None:
    """A ``--chat-template`` value as vLLM reads it (``load_chat_template``): the text of the file it names, or,
    when no such file opens and it holds a Jinja character (``{``, ``}`` or a newline), the template itself with
    its backslash escapes decoded (``\\n`` on a command line is a newline). None stays None.

    Raises:
        ValueError: it looks like a file path (no Jinja character) and does not open."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"chat_template: {value!r} looks like a file path, but it could not be opened: "
                             f"{exc.strerror}") from None
    import codecs

    return codecs.decode(value, "unicode_escape")


def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` (jinja2) compiled as a model's chat template is (``_compile_template``).

    Raises:
        ValueError: ``chat_template: not a valid template: ...``."""
    try:
        return _compile_template(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat_template: not a valid template: {exc}") from None


def load_tokenizer(path: str, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a model path: a HF directory's or a ``.gguf`` file's
    (what ``engine.model_loader.load_model`` builds, without torch or weights;
    the front end of an engine whose core runs in another process uses it),
    rendering ``chat_template`` (jinja2 source: ``EngineArgs.chat_template_source``) instead of the model's
    when given.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file holds no usable tokenizer.
    """
    import os

    if os.path.isdir(path):
        tokenizer = Tokenizer.from_hf_dir(path)
    elif os.path.isfile(path):
        tokenizer = Tokenizer.from_gguf(path)
    else:
        raise FileNotFoundError(f"model {path!r}: no such file or directory")
    return tokenizer.with_chat_template(chat_template) if chat_template is not None else tokenizer
