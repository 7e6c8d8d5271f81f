"""What a front end checks of a request against the engine's settings before the core sees it (vLLM V1's input
processor): the OpenAI server (``engine/serving/serving.py``, each problem a 400 naming its field) and the offline
``LLM`` (``LLMEngine.add_request``, a ``ValueError``) read the same rules here, so a request refused by one is
refused by the other in the same words (``dimensions_problem``: the embeddings endpoint and ``LLM.embed``). Rules
that need no engine setting live in ``SamplingParams`` itself. Imports no torch (the serving process loads none)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class InputProblem:
    """Why a request is refused: ``field`` (the ``SamplingParams`` field or ``priority``) and a one-line
    ``message``."""

    field: str
    message: str


def logprobs_problem(params: SamplingParams, max_logprobs: int, vocab_size: int) -> InputProblem | None:
    """``logprobs`` or ``prompt_logprobs`` above the engine's ``max_logprobs`` (vLLM's ``--max-logprobs``; -1, in
    either, counts as ``vocab_size``), in vLLM's words (vllm/v1/engine/processor.py ``_validate_logprobs``); None
    when both fit."""
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for kind, field in (("sample", "logprobs"), ("prompt", "prompt_logprobs")):
        asked = getattr(params, field)
        asked = vocab_size if asked == -1 else asked
        if asked is not None and asked > cap:
            return InputProblem(field, f"Requested {kind} logprobs of {asked}, which is greater than max allowed: "
                                       f"{cap} (max_logprobs, --max-logprobs)")
    return None


def with_vocab_logprobs(params: SamplingParams, vocab_size: int, max_logprobs: int) -> SamplingParams:
    """``params`` with a ``logprobs`` / ``prompt_logprobs`` of -1 (vLLM's "every token") as ``vocab_size``, the
    count the sampler computes; ``params`` itself when neither is -1.

    Raises:
        ValueError: either over ``max_logprobs`` (``logprobs_problem``'s message)."""
    if (problem := logprobs_problem(params, max_logprobs, vocab_size)) is not None:
        raise ValueError(problem.message)
    if params.logprobs != -1 and params.prompt_logprobs != -1:
        return params
    whole = {f: vocab_size for f in ("logprobs", "prompt_logprobs") if getattr(params, f) == -1}
    return dataclasses.replace(params, **whole)


def priority_problem(priority: int, scheduling_policy: str) -> InputProblem | None:
    """A non-zero ``priority`` on an engine that does not schedule by priority (vLLM refuses it: it would be
    silently ignored); None otherwise."""
    if priority != 0 and scheduling_policy != "priority":
        return InputProblem("priority", f"priority: got {priority}, but Priority scheduling is not enabled: this "
                                        f"engine schedules {scheduling_policy} (start it with --scheduling-policy "
                                        "priority, or LLM(scheduling_policy=\"priority\"), to use request priorities)")
    return None


def token_id_problem(params: SamplingParams, vocab_size: int) -> InputProblem | None:
    """The first id of ``stop_token_ids``, ``allowed_token_ids`` or ``logit_bias``'s keys outside
    ``[0, vocab_size)``: a token this model can never sample, a mistyped id (vLLM refuses out-of-vocab ids of
    ``allowed_token_ids`` and ``logit_bias``); None when all are the model's."""
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        ids = getattr(params, name) or ()
        for i, t in enumerate(ids):
            if t >= vocab_size:
                where = name if isinstance(ids, dict) else f"{name}[{i}]"
                return InputProblem(name, f"{where}: {t} is not a token id of this model (ids are in "
                                          f"[0, {vocab_size}))")
    return None


def dimensions_problem(dimensions: int | None, model_name: str) -> str | None:
    """Why ``dimensions`` (OpenAI's and vLLM's reduced embedding size) is refused, in vLLM's words, or None when it
    is not given: this engine reads no matryoshka config (``is_matryoshka``), so every model pools its full
    ``hidden_size``."""
    if dimensions is None:
        return None
    return (f'dimensions: Model "{model_name}" does not support matryoshka representation, changing output '
            "dimensions will lead to poor results.")


def check_input(params: SamplingParams, priority: int, *, vocab_size: int, max_logprobs: int,
                scheduling_policy: str) -> SamplingParams:
    """Every rule above for one offline request; ``params`` as the core takes them (``with_vocab_logprobs``).

    Raises:
        ValueError: the first problem's message (it names the field)."""
    if (problem := priority_problem(priority, scheduling_policy)) is not None:
        raise ValueError(problem.message)
    params = with_vocab_logprobs(params, vocab_size, max_logprobs)   # the logprobs rule, checked there
    if (problem := token_id_problem(params, vocab_size)) is not None:
        raise ValueError(problem.message)
    return params
