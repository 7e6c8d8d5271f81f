"""What a scheduler refuses to queue: a request that could never run under its limits (``Scheduler.add_request``)."""

from __future__ import annotations

from engine.core.request import Request


def check_admissible(request: Request, scheduler) -> None:
    """Raise if ``request`` could never run on ``scheduler`` (an ``engine.core.scheduler.Scheduler``).

    Raises:
        ValueError: empty prompt; a duplicate request_id; max_tokens below 1 (a pooling request: not 0, or n > 1);
            prompt + max_tokens above ``max_model_len``; without chunked prefill a prompt above
            ``max_num_batched_tokens``; a sequence that could never fit in the KV cache; n above ``max_num_seqs``.
    """
    s = scheduler
    n_prompt = request.num_prompt_tokens
    if n_prompt == 0:
        raise ValueError("prompt must contain at least one token")
    if request.request_id in s.requests:
        raise ValueError(f"request_id {request.request_id!r} is already in use")
    pooling = request.pooling_params is not None
    if request.max_tokens < 1 and not pooling:
        raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
    if pooling and (request.max_tokens != 0 or request.group is not None):
        raise ValueError("a pooling request samples nothing: max_tokens 0, no n > 1")
    if n_prompt > s.max_model_len:
        raise ValueError(f"prompt has {n_prompt} tokens, more than max_model_len={s.max_model_len}")
    if n_prompt + request.max_tokens > s.max_model_len:
        raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({request.max_tokens}) = "
                         f"{n_prompt + request.max_tokens} tokens exceeds max_model_len={s.max_model_len}")
    if not s.enable_chunked_prefill and n_prompt > s.max_num_batched_tokens:
        raise ValueError(f"prompt has {n_prompt} tokens, more than max_num_batched_tokens="
                         f"{s.max_num_batched_tokens} (enable chunked prefill or raise the limit)")
    # The last sampled token is never written to the cache (a pooling request's last prompt token is).
    capacity = (s.num_blocks - 1) * s.block_size
    if n_prompt + max(request.max_tokens - 1, 0) > capacity:
        raise ValueError(f"prompt + max_tokens - 1 = {n_prompt + request.max_tokens - 1} tokens do not fit in the KV "
                         f"cache ({s.num_blocks - 1} blocks of {s.block_size} = {capacity} tokens); "
                         f"lower max_tokens or give the KV cache more memory")
    if request.group is not None and len(request.group.members) > s.max_num_seqs:
        raise ValueError(f"n={len(request.group.members)} exceeds max_num_seqs={s.max_num_seqs}")
