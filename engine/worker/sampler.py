"""Batched token sampling: logits processors, the exponential race, logprobs.

One call of ``Sampler.sample`` handles a whole step's batch in a single pass:

1. ``raw_logprobs = log_softmax(logits)`` when some row asks for logprobs.
   Logprobs are always taken from the model's RAW distribution, before
   penalties, ``min_tokens``, temperature, top-k, top-p and min-p (vLLM v1's
   default ``raw_logprobs`` mode). The sampled token's logprob therefore does
   not depend on ``logprobs`` (k) nor on the sampling parameters.
2. ``allowed_token_ids`` (every other token gets ``-inf``) and ``bad_words``
   (the tokens that would complete one get ``-inf``): vLLM's, ``engine/worker/token_restrictions.py``; then
   ``logit_bias`` (OpenAI's: added to the logits of its tokens), then
   penalties (rows that use them only, all rows incl. greedy ones, as vLLM):
   repetition penalty over prompt + output tokens (CTRL, Keskar et al. 2019,
   Hugging Face semantics: a positive logit is divided by it, a negative one
   multiplied), then OpenAI's frequency and presence penalties over output
   tokens (``logit -= count * frequency + (count > 0) * presence``).
3. ``min_tokens``: while ``num_output_tokens < min_tokens`` the EOS token
   (unless ``ignore_eos``) and ``stop_token_ids`` get ``-inf``, in
   unconstrained rows. Then the grammar bitmask of constrained rows
   (structured outputs, when given): forbidden tokens get ``-inf``; other
   rows are not touched. The grammar's mask already settled EOS, stop token
   ids and ``min_tokens`` of its rows (``engine/worker/structured_outputs.py``).
4. Greedy rows (temperature 0, or below 1e-5): argmax of the processed
   logits (penalties and min_tokens apply to greedy rows too, as in vLLM).
5. Random rows: divide by temperature, then top-k, top-p (nucleus, Holtzman
   et al. 2019: keep the smallest set of most likely tokens whose mass
   reaches top_p) and min-p (drop tokens with ``p < min_p * p_max``), then
   sample by the exponential race: ``argmax(probs / E)`` with
   ``E ~ Exponential(1)`` i.i.d. per token, which draws index i with
   probability ``probs[i]`` (equivalent to the Gumbel-max trick).
   A seeded request draws ``E`` for output position k from its own
   ``torch.Generator`` seeded with a hash of (``sampling_params.seed +
   request.index``, k), so its tokens do not depend on its batch-mates, and
   a continuation from position k (``EngineCore.add_request(resume=...)``)
   draws what the uninterrupted request would have drawn there;
   unseeded rows share one draw from the sampler's generator.

The only host synchronisation of a step is one ``.tolist()`` at the end
(token ids and logprobs are packed into one float64 tensor first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.outputs import Logprob, PositionLogprobs
from engine.core.request import Request
from engine.worker.token_restrictions import banned_next_tokens
from engine.worker.structured_outputs import GrammarBitmask, apply_token_bitmask
from engine.worker.top_k_top_p import apply_top_k_top_p

_U64 = (1 << 64) - 1
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them
# would overflow the logits.
_SAMPLING_EPS = 1e-5
_F32 = torch.finfo(torch.float32)


@dataclass
class SamplerOutput:
    """What one ``Sampler.sample`` call produced.

    Attributes:
        token_ids: one sampled token id per logits row.
        logprobs: per row, ``{token_id: Logprob}`` (the sampled token first,
            then the top ``sampling_params.logprobs`` tokens) when the row's
            request asked for logprobs, else None. ``decoded_token`` is left
            "" (the engine fills it, see ``engine.detokenizer.decode_token``).
    """

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)


class Sampler:
    """Samples the next token of every row of a batch's logits.

    Args:
        vocab_size: the model's vocabulary size (logits' last dimension may
            be padded larger; the logits' own width is what is used).
        device: where logits live; per-request generators are created there.
        seed: seed of the generator used for unseeded rows (None: torch's
            default generator, e.g. seeded by ``torch.manual_seed``).
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int | None = None):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generator: torch.Generator | None = None
        if seed is not None:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(seed & _U64)
        self._seeded: dict[str, torch.Generator] = {}

    def free(self, request_id: str) -> None:
        """Forget a finished (or aborted) request's generator; no-op if none."""
        self._seeded.pop(request_id, None)

    def _request_generator(self, request: Request) -> torch.Generator:
        """The request's generator, seeded for its next output position (the draw of position k depends only on
        the seed, the choice index and k: a resumed request continues the same draws)."""
        gen = self._seeded.get(request.request_id)
        if gen is None:
            gen = self._seeded[request.request_id] = torch.Generator(device=self.device)
        gen.manual_seed(position_seed(request.sampling_params.seed + request.index, request.num_output_tokens))
        return gen

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request],
               grammar_bitmask: GrammarBitmask | None = None) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[num_rows, vocab]`` float32 (other float dtypes are
                upcast), raw model output; not modified.
            requests: ``requests[i]`` owns row ``i``; its ``prompt_token_ids``,
                ``output_token_ids`` (tokens generated before this step),
                ``eos_token_id`` and ``sampling_params`` are read.
            grammar_bitmask: allowed tokens of the constrained rows
                (structured outputs), or None.

        Returns:
            ``SamplerOutput`` with one token id per row (and logprobs where
            asked).

        Raises:
            ValueError: ``logits`` is not 2-D or its row count differs from
                ``len(requests)``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [num_rows={len(requests)}, vocab], got {tuple(logits.shape)}")
        num_rows = len(requests)
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        device = logits.device
        logits = logits.float()
        params = [r.sampling_params for r in requests]

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            lp_idx = None if len(lp_rows) == num_rows else _to_device(lp_rows, torch.long, device)
            raw_logprobs = torch.log_softmax(logits if lp_idx is None else logits[lp_idx], dim=-1)

        logits = _apply_penalties(_apply_logit_bias(_apply_token_restrictions(logits, requests), requests), requests)
        constrained = set(grammar_bitmask.rows) if grammar_bitmask is not None else set()
        logits = _apply_min_tokens(logits, requests, constrained)
        if grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, grammar_bitmask)

        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if not random_rows:
            token_ids = argmax_rows(logits)
        elif len(random_rows) == num_rows:
            token_ids = self._sample_random(logits, requests)
        else:
            idx = _to_device(random_rows, torch.long, device)
            sampled = self._sample_random(logits[idx], [requests[i] for i in random_rows])
            token_ids = argmax_rows(logits).index_copy(0, idx, sampled)

        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids.tolist(), logprobs=[None] * num_rows)

        k = min(max(params[i].logprobs for i in lp_rows), logits.shape[-1])
        chosen = token_ids if lp_idx is None else token_ids[lp_idx]
        packed = _pack_logprobs(raw_logprobs, chosen, k)
        flat = torch.cat([token_ids.double(), packed.flatten()]).tolist()  # the one host sync
        ids = [int(t) for t in flat[:num_rows]]
        rows = _unpack_logprobs(flat[num_rows:], len(lp_rows), k, [min(params[i].logprobs, k) for i in lp_rows])
        logprobs: list[PositionLogprobs | None] = [None] * num_rows
        for i, row in zip(lp_rows, rows):
            logprobs[i] = row
        return SamplerOutput(token_ids=ids, logprobs=logprobs)

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and the exponential race.

        Args:
            logits: ``[n, vocab]`` float32 (penalties already applied).
            requests: the n rows' requests, all with temperature > 0.

        Returns:
            ``[n]`` int64 sampled token ids (on the logits' device).
        """
        device = logits.device
        n, vocab = logits.shape
        params = [r.sampling_params for r in requests]
        x = logits / _to_device([p.temperature for p in params], torch.float32, device).unsqueeze(1)
        if any(p.repetition_penalty != 1.0 for p in params):
            # finite: a penalised logit near float32's largest (an extreme repetition_penalty; no other logit
            # comes near it) over a temperature below 1 would be +inf, and a row holding +inf has a NaN softmax
            x.clamp_(max=_F32.max)

        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            x = apply_top_k_top_p(x, top_k, top_p)  # only these rows are ranked
        probs = torch.softmax(x, dim=-1)
        if any(min_p):
            mp = _to_device(min_p, torch.float32, device).unsqueeze(1)
            probs = probs.masked_fill(probs < mp * probs.amax(dim=-1, keepdim=True), 0.0)

        # Exponential race: one Exponential(1) draw per (row, token).
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        # E = -log(U), U ~ Uniform[0, 1): several times faster than exponential_ on CPU.
        # U = 0 gives E = inf, i.e. that token cannot win (probability 2^-24).
        noise = torch.empty_like(probs)
        if len(unseeded) == n:
            noise.uniform_(generator=self._generator)
        elif unseeded:
            draw = torch.empty((len(unseeded), vocab), device=device).uniform_(generator=self._generator)
            noise.index_copy_(0, _to_device(unseeded, torch.long, device), draw)
        for i in seeded:
            noise[i].uniform_(generator=self._request_generator(requests[i]))
        noise.log_().neg_()
        return argmax_rows(probs / noise)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64 [rows]: the first maximum of each row, a NaN before any number), on CPU
    through numpy, which gives the same index: on a 49,152-token row numpy took 21 us and torch 82-110 us
    (the 2-core AVX512-BF16 EPYC), 1-1.5 % of a one-row decode step."""
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    return torch.from_numpy(x.numpy().argmax(axis=-1))


def picks_raw_argmax(request: Request) -> bool:
    """Whether this sampler's next token for ``request`` is the first maximum of the model's raw logits with
    nothing else reported: greedy, no penalties, logit_bias, allowed_token_ids or bad_words, ``min_tokens``
    reached, no grammar, no logprobs (what several greedy decode steps in one call may compute in its stead:
    ``engine/core/multi_step.py``)."""
    p = request.sampling_params
    return (p.temperature < _SAMPLING_EPS and p.logprobs is None and p.structured_outputs is None
            and request.num_output_tokens >= p.min_tokens and not _has_penalty(request) and not p.logit_bias
            and not p.allowed_token_ids and not p.bad_words_token_ids)


def position_seed(seed: int, position: int) -> int:
    """The seed of output position ``position`` of a sequence seeded ``seed``: splitmix64 of both (a bijective
    mix, so neighbouring seeds and positions give unrelated streams)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def prompt_logprobs(logits: torch.Tensor, target_ids: list[int], k: int) -> list[PositionLogprobs]:
    """Logprobs of the prompt tokens (OpenAI's ``echo`` + logprobs, vLLM's
    ``prompt_logprobs``), from the raw distribution.

    Args:
        logits: ``[num_positions, vocab]`` float32; row i is the model's
            prediction for ``target_ids[i]`` (the token after position i).
        target_ids: the actual next tokens, ``len == num_positions``.
        k: number of top logprobs per position (0: only the target's).

    Returns:
        One ``{token_id: Logprob}`` per position: the target first (with its
        rank), then the top-k.

    Raises:
        ValueError: shapes disagree.
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(f"logits must be [{len(target_ids)}, vocab], got {tuple(logits.shape)}")
    if not target_ids:
        return []
    with torch.inference_mode():
        raw = torch.log_softmax(logits.float(), dim=-1)
        targets = _to_device(target_ids, torch.long, logits.device)
        k = min(k, raw.shape[-1])
        flat = _pack_logprobs(raw, targets, k).flatten().tolist()
    return _unpack_logprobs(flat, len(target_ids), k, [k] * len(target_ids))


def collect_prompt_logprobs(scheduled: list, prompt_logits: dict[str, torch.Tensor],
                            collected: dict[str, list[PositionLogprobs]]) -> None:
    """Store a step's prompt logprobs at their positions (``prompt_logprobs``; the logits at position p score
    token p+1) into ``collected`` (parent request id -> the positions so far) for each scheduled entry (a
    ``ScheduledRequest``) with logits in ``prompt_logits`` (request id -> [rows, vocab] float32); positions already
    stored (a chunk recomputed after preemption) keep their first value.

    Raises:
        RuntimeError: positions before the chunk are missing (a cached prefix was read).
    """
    for entry in scheduled:
        req = entry.request
        logits = prompt_logits.get(req.request_id)
        done = collected.get(req.parent_id)
        if logits is None or req.index != 0 or done is None:
            continue
        start = entry.num_computed_tokens
        end = min(start + entry.num_new_tokens, req.num_prompt_tokens)
        targets = req.prompt_token_ids[start + 1:end + 1]
        if start + 1 > len(done):
            raise RuntimeError(f"request {req.parent_id}: prompt logprobs missing before position {start + 1} "
                               "(a cached prefix was read)")
        new = targets[len(done) - start - 1:]
        if new:
            done.extend(prompt_logprobs(logits[len(targets) - len(new):len(targets)], new,
                                        req.sampling_params.prompt_logprobs))


def _pack_logprobs(raw: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """``[n, 3 + 2k]`` float64: chosen id, its logprob, its rank (1 = most
    likely: 1 + number of tokens with a strictly larger logprob), then k top
    ids and k top logprobs. Ids are exact in float64."""
    chosen_lp = raw.gather(1, chosen.unsqueeze(1))
    rank = (raw > chosen_lp).sum(dim=-1, keepdim=True) + 1
    cols = [chosen.unsqueeze(1).double(), chosen_lp.double(), rank.double()]
    if k > 0:
        top = raw.topk(k, dim=-1)
        cols += [top.indices.double(), top.values.double()]
    return torch.cat(cols, dim=1)


def _unpack_logprobs(flat: list[float], n: int, k: int, ks: list[int]) -> list[PositionLogprobs]:
    width = 3 + 2 * k if k > 0 else 3
    out: list[PositionLogprobs] = []
    for r in range(n):
        row = flat[r * width:(r + 1) * width]
        entry: PositionLogprobs = {int(row[0]): Logprob(logprob=row[1], rank=int(row[2]))}
        for j in range(ks[r]):
            tid = int(row[3 + j])
            if tid not in entry:
                entry[tid] = Logprob(logprob=row[3 + k + j], rank=j + 1)
        out.append(entry)
    return out


def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (over prompt + output), then frequency and presence (over
    output) penalties, on the rows whose request uses any. Out of place."""
    rows = [i for i, r in enumerate(requests) if _has_penalty(r)]
    if not rows:
        return logits
    device = logits.device
    vocab = logits.shape[-1]
    reqs = [requests[i] for i in rows]
    idx = _to_device(rows, torch.long, device)
    x = logits[idx]

    rep = [r.sampling_params.repetition_penalty for r in reqs]
    if any(p != 1.0 for p in rep):
        seen = _token_mask([r.all_token_ids for r in reqs], vocab, device)
        # in float32's normal range, and the results finite: a penalty of 1e-300 (taken: vLLM's rule is > 0)
        # was 0 in float32, its logits +inf, and a sampled row's softmax NaN: token 0 every step (a trial)
        rep = [min(max(p, _F32.tiny), _F32.max) for p in rep]
        rp = _to_device(rep, torch.float32, device).unsqueeze(1).expand_as(x)
        penalised = torch.where(x > 0, x / rp, x * rp).clamp_(max=_F32.max)
        x = torch.where(seen, penalised, x)

    freq = [r.sampling_params.frequency_penalty for r in reqs]
    pres = [r.sampling_params.presence_penalty for r in reqs]
    if any(freq) or any(pres):
        counts = _token_counts([r.output_token_ids for r in reqs], vocab, device)
        x = x - counts * _to_device(freq, torch.float32, device).unsqueeze(1)
        x = x - (counts > 0).float() * _to_device(pres, torch.float32, device).unsqueeze(1)

    return logits.index_copy(0, idx, x)


def _has_penalty(r: Request) -> bool:
    p = r.sampling_params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _apply_token_restrictions(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``-inf`` on every token outside a row's ``allowed_token_ids`` and on the tokens its ``bad_words`` ban
    after its output so far (ids past the vocabulary: none). Out of place; each row on its own (batch
    invariant)."""
    vocab = logits.shape[-1]
    device = logits.device
    restricted = [i for i, r in enumerate(requests) if r.sampling_params.allowed_token_ids]
    if restricted:
        keep = torch.zeros((len(restricted), vocab), dtype=torch.bool)
        for j, i in enumerate(restricted):
            keep[j, [t for t in requests[i].sampling_params.allowed_token_ids if t < vocab]] = True
        idx = _to_device(restricted, torch.long, device)
        logits = logits.index_copy(0, idx, logits[idx].masked_fill(~keep.to(device), float("-inf")))
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(requests):
        if sequences := r.sampling_params.bad_words_token_ids:
            for t in banned_next_tokens(sequences, r.output_token_ids):
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
    return _put(logits, rows, cols, torch.tensor(float("-inf"), device=device)) if rows else logits


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Each row's ``logit_bias`` added to its tokens' logits (ids past the vocabulary: none; the serving layer
    refuses them). Out of place; one scatter for the batch, each element its own sum (batch invariant)."""
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    vocab = logits.shape[-1]
    for i, r in enumerate(requests):
        for t, b in (r.sampling_params.logit_bias or {}).items():
            if t < vocab:
                rows.append(i)
                cols.append(t)
                biases.append(float(b))
    return _put(logits, rows, cols, _to_device(biases, torch.float32, logits.device), accumulate=True) if rows \
        else logits


def _apply_min_tokens(logits: torch.Tensor, requests: list[Request], constrained: set[int]) -> torch.Tensor:
    """``-inf`` on EOS (unless ignore_eos) and stop_token_ids for rows with
    fewer than ``min_tokens`` output tokens, except the ``constrained`` rows
    (their grammar mask settles termination: it never bans the only tokens
    the grammar allows). Out of place."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[-1]
    for i, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens >= p.min_tokens or i in constrained:
            continue
        banned = set(p.stop_token_ids)
        if r.eos_token_id is not None and not p.ignore_eos:
            banned.add(r.eos_token_id)
        for t in sorted(banned):
            if t < vocab:
                rows.append(i)
                cols.append(t)
    return _put(logits, rows, cols, torch.tensor(float("-inf"), device=logits.device)) if rows else logits


def _put(logits: torch.Tensor, rows: list[int], cols: list[int], values: torch.Tensor,
         accumulate: bool = False) -> torch.Tensor:
    """``logits`` with ``values`` put (or, ``accumulate``, added) at ``(rows[i], cols[i])``; out of place."""
    device = logits.device
    return logits.index_put((_to_device(rows, torch.long, device), _to_device(cols, torch.long, device)), values,
                            accumulate=accumulate)


def _token_mask(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(token_lists), vocab]`` bool: True where the token occurs."""
    return _token_counts(token_lists, vocab, device) > 0


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float32 occurrence counts."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32, device=device)
    if width == 0:
        return counts[:, :vocab]
    padded = [list(t) + [vocab] * (width - len(t)) for t in token_lists]
    ids = _to_device(padded, torch.long, device).clamp_(0, vocab)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list to a tensor on ``device`` without a blocking copy (pinned
    memory + non_blocking on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
