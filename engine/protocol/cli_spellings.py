"""vLLM's other spellings of a command line's long options (its ``FlexibleArgumentParser``), read by the ``tandem``
command before it parses ``tandem engine`` and ``tandem generate``: standard library only, as the rest of
``engine/protocol/`` (the gateway's dispatcher imports it; ``engine/entrypoints/`` stays ``tandem engine serve``'s)."""

from __future__ import annotations

import json


def vllm_argv(argv: list[str]) -> list[str]:
    """``argv`` with vLLM's other spellings of long options made this CLI's, as vLLM's ``FlexibleArgumentParser``
    reads them: underscores for dashes (``--tensor_parallel_size 2``), and a JSON option given key by key
    (``--speculative-config.method ngram --speculative-config.num_speculative_tokens 3``: one
    ``--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'``, each value read as JSON where it
    is JSON, else as the string). Tokens after a bare ``--`` and values are left as they are."""

    out: list[str] = []
    merged: dict[str, tuple[int, dict]] = {}   # option -> (its index in out, its keys so far)
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            out += argv[i:]
            break
        if not tok.startswith("--"):
            out.append(tok)
            i += 1
            continue
        name, eq, value = tok.partition("=")
        name = "--" + name[2:].replace("_", "-")
        option, dot, key = name.partition(".")
        if not dot:
            out.append(name + eq + value)
            i += 1
            continue
        if not eq:   # the key's value is the next token
            value, i = (argv[i + 1], i + 2) if i + 1 < len(argv) else ("", i + 1)
        else:
            i += 1
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        key = key.replace("-", "_")
        if option not in merged:
            merged[option] = (len(out) + 1, {})
            out += [option, ""]
        merged[option][1][key] = parsed
        out[merged[option][0]] = json.dumps(merged[option][1])
    return out
