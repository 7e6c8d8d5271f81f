"""Whether a sampled token finishes its request (vLLM's ``check_stop``, ``vllm/v1/core/sched/utils.py``)."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus


def check_stop(req: Request, token: int, max_model_len: int,
               content: bool = False) -> tuple[RequestStatus | None, int | None]:
    """(finished status or None, stop_reason) after ``token`` was appended to ``req``: EOS (unless ``ignore_eos``)
    or a stop token id (unless ``content``: its grammar could go on no other way), neither before ``min_tokens``
    outputs, stop it; ``max_tokens`` outputs or ``max_model_len`` tokens end it for length."""
    params = req.sampling_params
    if req.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and req.eos_token_id is not None and token == req.eos_token_id:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids and not content:
            return RequestStatus.FINISHED_STOPPED, token
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None
