"""Workloads: what each load-test request asks for.

A workload is a list of :class:`RequestSpec` (one OpenAI request body each);
the runner cycles through it. Two sources:

* MT-Bench (``loadtests/data/mt_bench_questions.jsonl``, 80 two-turn questions from
  lm-sys/FastChat): turn 1 alone, or turn 1 + an assistant answer + turn 2,
  which shares the turn-1 prefix (the prefix-caching workload).
* Synthetic prompts of a configurable input length in words (~1 token each
  for a BPE tokenizer: common short English words with a leading space) and a
  configurable output length (``max_tokens``), each drawn from a distribution.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

# The prompt data of the load tests and benchmarks (loadtests/data/README.md says where each is from); shipped in
# the wheel (pyproject's package-data), so an installed `tandem loadtest` / `tandem bench` finds it
DATA = Path(__file__).resolve().parent / "data"
MT_BENCH_PATH = DATA / "mt_bench_questions.jsonl"
EDIT_TEXTS_PATH = DATA / "edit_texts.json"
JSON_SCHEMAS_PATH = DATA / "json_schemas.json"

# Short, frequent English words: each is one token in GPT-2/Llama-style BPE
# vocabularies (with its leading space), so a prompt of N words is ~N tokens.
_WORDS = ("the of and to in is was for on that with as by at from his her an are this had not but be "
          "have one all were they which you their has been can more when who will she so no if out up "
          "we time my than them some him into its then only two may other new our first any these made "
          "over see also after did most way many well year work back down day good just each much").split()

# Answer used in place of a model's turn-1 reply when none is supplied.
CANNED_ANSWER = ("Sure. Here is a detailed answer to your question, covering the main points one by one, "
                 "with examples where they help and a short summary at the end.")


@dataclass
class RequestSpec:
    """One request of a workload.

    Attributes:
        messages: chat messages (used by the chat endpoint).
        prompt: the same conversation as one text prompt (completions endpoint).
        max_tokens: output length limit, tokens.
        tag: where it came from, e.g. ``"mtbench:81:t2"`` or ``"synthetic:17"``.
        extra: extra body fields (e.g. ``{"ignore_eos": True}``).
    """

    messages: list[dict]
    prompt: str
    max_tokens: int
    tag: str = ""
    extra: dict = field(default_factory=dict)

    def body(self, endpoint: str, model: str, stream: bool, include_usage: bool = True) -> dict:
        """The OpenAI request body for ``endpoint`` ("chat" or "completions")."""
        body: dict = {"model": model, "max_tokens": self.max_tokens, "stream": stream}
        if endpoint == "chat":
            body["messages"] = self.messages
        elif endpoint == "completions":
            body["prompt"] = self.prompt
        else:
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {endpoint!r}")
        if stream and include_usage:
            body["stream_options"] = {"include_usage": True}
        body.update(self.extra)
        return body


def messages_to_prompt(messages: list[dict]) -> str:
    """A plain-text rendering of chat messages for the completions endpoint."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def load_mt_bench(path: str | Path = MT_BENCH_PATH) -> list[dict]:
    """The MT-Bench questions: dicts with ``question_id``, ``category``, ``turns``.

    Raises:
        FileNotFoundError: no such file.
    """
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mt_bench_turn1(max_tokens: int, num_prompts: int | None = None, path: str | Path = MT_BENCH_PATH,
                   extra: dict | None = None) -> list[RequestSpec]:
    """Turn 1 of each MT-Bench question (the first ``num_prompts``, all by default)."""
    out = []
    for q in load_mt_bench(path)[:num_prompts]:
        messages = [{"role": "user", "content": q["turns"][0]}]
        out.append(RequestSpec(messages, messages_to_prompt(messages), max_tokens,
                               f"mtbench:{q['question_id']}:t1", dict(extra or {})))
    return out


def mt_bench_turn2(max_tokens: int, num_prompts: int | None = None, answers: dict[int, str] | None = None,
                   path: str | Path = MT_BENCH_PATH, extra: dict | None = None) -> list[RequestSpec]:
    """Turn 1 + assistant answer + turn 2 of each question.

    The prompt's head is exactly the turn-1 conversation, so a server with
    prefix caching can reuse turn 1's KV blocks.

    Args:
        answers: question_id -> the assistant's turn-1 reply (e.g. what the
            server answered); missing ones use :data:`CANNED_ANSWER`.
    """
    answers = answers or {}
    out = []
    for q in load_mt_bench(path)[:num_prompts]:
        messages = [{"role": "user", "content": q["turns"][0]},
                    {"role": "assistant", "content": answers.get(q["question_id"], CANNED_ANSWER)},
                    {"role": "user", "content": q["turns"][1]}]
        out.append(RequestSpec(messages, messages_to_prompt(messages), max_tokens,
                               f"mtbench:{q['question_id']}:t2", dict(extra or {})))
    return out


@dataclass
class LengthDist:
    """A distribution of lengths in tokens, parsed from ``"kind:a[,b]"``.

    Kinds: ``fixed:N``, ``uniform:LO,HI`` (inclusive), ``normal:MEAN,STD``,
    ``exponential:MEAN``. Draws are rounded and clipped to >= 1.
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | int) -> "LengthDist":
        """``"128"`` = ``fixed:128``. Raises ValueError on a bad spec."""
        text = str(text).strip()
        kind, _, rest = text.partition(":") if ":" in text else ("fixed", "", text)
        try:
            nums = [float(x) for x in rest.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"bad length distribution {text!r} (e.g. fixed:128, uniform:64,256)") from None
        want = {"fixed": 1, "uniform": 2, "normal": 2, "exponential": 1}
        if kind not in want or len(nums) != want[kind]:
            raise ValueError(f"bad length distribution {text!r}: use fixed:N, uniform:LO,HI, normal:MEAN,STD "
                             "or exponential:MEAN")
        if kind == "uniform" and nums[0] > nums[1]:
            raise ValueError(f"bad length distribution {text!r}: LO > HI")
        if min(nums) < 0 or nums[0] < 1:
            raise ValueError(f"bad length distribution {text!r}: lengths must be >= 1")
        return cls(kind, nums[0], nums[1] if len(nums) > 1 else 0.0)

    def sample(self, rng: random.Random) -> int:
        """One length, tokens (>= 1)."""
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        else:
            x = rng.expovariate(1.0 / self.a)
        return max(1, int(round(x)))


def synthetic(num_prompts: int, input_len: LengthDist, output_len: LengthDist, seed: int = 0,
              extra: dict | None = None) -> list[RequestSpec]:
    """``num_prompts`` random prompts: input length in words drawn from
    ``input_len``, ``max_tokens`` from ``output_len``. Deterministic for a seed.
    Each prompt starts with its own index so no two share a prefix block.
    """
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        n_in = input_len.sample(rng)
        words = [str(i)] + [rng.choice(_WORDS) for _ in range(n_in - 1)]
        text = " ".join(words)
        messages = [{"role": "user", "content": text}]
        out.append(RequestSpec(messages, text, output_len.sample(rng), f"synthetic:{i}", dict(extra or {})))
    return out


def build_workload(name: str, *, num_prompts: int | None, max_tokens: int = 128, input_len: str = "fixed:128",
                   output_len: str | None = None, seed: int = 0, ignore_eos: bool = False) -> list[RequestSpec]:
    """A workload by name: ``mtbench`` (turn 1), ``mtbench-turn2`` or ``synthetic``.

    ``output_len`` (a :class:`LengthDist` spec) defaults to ``fixed:max_tokens``.

    Raises:
        ValueError: unknown name or bad length spec.
    """
    extra = {"ignore_eos": True} if ignore_eos else {}
    if name == "mtbench":
        return mt_bench_turn1(max_tokens, num_prompts, extra=extra)
    if name == "mtbench-turn2":
        return mt_bench_turn2(max_tokens, num_prompts, extra=extra)
    if name == "synthetic":
        return synthetic(num_prompts or 100, LengthDist.parse(input_len),
                         LengthDist.parse(output_len or f"fixed:{max_tokens}"), seed, extra)
    raise ValueError(f"unknown workload {name!r}: use mtbench, mtbench-turn2 or synthetic")
