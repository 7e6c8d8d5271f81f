"""The resume phase of scenario 7 (``tandem loadtest replicas --resume-streams N``): streams that outlive their
replica (docs/operators/replicas.md).

For each of N MT-Bench questions (greedy and seeded sampled in turn): a reference stream on the ``resume`` route
(``prefix_affinity`` over the same replicas, ``resume: true``) without a failure, then the same request with the
replica serving it SIGKILLed after ``KILL_AFTER`` content chunks; the killed replica is restarted before the next
stream. Reported: streams whose text and finish reason equal the reference's bit for bit (target: all), streams
that failed, and the resume gap (from the kill to the next content chunk the client receives) p50 / p99.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from loadtests.stats import percentiles

KILL_AFTER = 16          # content chunks before the kill


def _stream(url: str, body: dict, on_chunk=None) -> tuple[str, str | None, str, float | None]:
    """(text, finish reason, serving backend, time of the first content chunk after ``on_chunk`` returned a
    time) of one streamed chat completion; ``on_chunk(count, backend)`` runs after each content chunk."""
    text, finish, killed_at, gap_end = "", None, None, None
    with httpx.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        backend = r.headers.get("x-tandem-backend", "")
        count = 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"].get("message"))
            for c in obj.get("choices") or ():
                piece = (c.get("delta") or {}).get("content") or ""
                finish = c.get("finish_reason") or finish
                if piece:
                    text += piece
                    count += 1
                    if killed_at is not None and gap_end is None:
                        gap_end = time.perf_counter()
                    if on_chunk is not None and killed_at is None:
                        killed_at = on_chunk(count, backend)
    return text, finish, backend, None if killed_at is None or gap_end is None else gap_end - killed_at


def resume_phase(gw_url: str, replicas: list, questions: list[dict], max_tokens: int, restart) -> dict:
    """Run the phase; ``replicas[i]`` is backend ``r<i>``; ``restart(i)`` starts replica i again on its port."""
    url = gw_url + "/v1/chat/completions"
    identical, failed, gaps, errors = 0, 0, [], []
    for i, q in enumerate(questions):
        body = {"model": "resume", "messages": [{"role": "user", "content": q["turns"][0]}],
                "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
        if i % 2:
            body.update(temperature=0.8, seed=1000 + i)
        ref = _stream(url, body)
        victim: list[int] = []

        def kill(count: int, backend: str) -> float | None:
            if count < KILL_AFTER:
                return None
            k = int(backend.lstrip("r"))
            os.killpg(os.getpgid(replicas[k].pid), signal.SIGKILL)   # the server and its engine process
            victim.append(k)
            return time.perf_counter()

        try:
            got = _stream(url, body, kill)
            identical += got[:2] == ref[:2]
            if got[3] is not None:
                gaps.append(got[3])
        except Exception as e:  # noqa: BLE001 -- counted and reported
            failed += 1
            errors.append(str(e)[:200])
        for k in victim:
            restart(k)
    p = percentiles(gaps)
    return {"streams": len(questions), "identical": identical, "failed": failed, "errors": errors,
            "resumed": len(gaps), "gap_p50_s": p and p["p50"], "gap_p99_s": p and p["p99"]}
