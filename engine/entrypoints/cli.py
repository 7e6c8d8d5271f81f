"""Engine sub-commands of ``tandem``: ``generate`` and ``engine serve``.

The engine's benchmarks (``tandem bench ...``) are the load tests' (``loadtests/bench/cli.py``): the engine
package imports neither ``loadtests`` nor ``gateway``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.config import add_engine_cli_args, engine_kwargs_from_cli


def register(subparsers) -> None:
    """Add ``generate`` and ``engine serve`` to the ``tandem`` CLI."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    gen = subparsers.add_parser("generate", help="generate a completion offline with the local engine",
                                formatter_class=fmt)
    gen.add_argument("--prompt", required=True, help="the user message (or the raw prompt with --raw)")
    gen.add_argument("--max-tokens", type=int, default=64, help="new tokens at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy; default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, (0, 1]")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_cli_args(gen)
    gen.set_defaults(func=_generate)

    eng = subparsers.add_parser("engine", help="the engine alone")
    eng_sub = eng.add_subparsers(dest="engine_command", required=True, metavar="COMMAND")
    serve = eng_sub.add_parser("serve", help="serve the engine behind its own OpenAI-compatible server",
                               formatter_class=fmt)
    from engine.entrypoints.server import add_serve_args, run_server

    add_serve_args(serve)
    serve.set_defaults(func=run_server)


def _generate(args: argparse.Namespace) -> int:
    """``tandem generate``: one completion on stdout; a bad argument, model path
    or memory setting is one ``error:`` line on stderr and exit status 1 (as
    ``engine serve``), not a traceback."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        llm = LLM(**engine_kwargs_from_cli(args))
    except (ValueError, FileNotFoundError, MemoryError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    try:
        if args.raw:
            out = llm.generate(args.prompt, params)[0]
        else:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    finally:   # its tensor-parallel ranks stopped, not left to find their driver gone (a trial's warning)
        llm.shutdown()
    sys.stdout.write(out.outputs[0].text + "\n")
    return 0
