"""Client side of the gateway's admin API, shared by the ``tandem ctl`` and
``tandem usage`` commands: the token from the environment, one HTTP call, the
OpenAI error message on failure."""

from __future__ import annotations

import os
import sys


def admin_call(command: str, url: str, token_env: str, method: str, path: str, *,
               params: dict | None = None, body: dict | None = None) -> tuple[int, object]:
    """Call ``method path`` on the gateway at ``url`` with the admin token in
    ``$token_env``.

    Returns:
        (exit code, decoded JSON or text): 0 and the answer; 2 when the token
        is unset, 1 when the gateway is unreachable or answers >= 400 (the
        reason is printed on stderr, prefixed with ``command``).
    """
    import httpx   # lazy: only these commands need it, every other `tandem` command starts without it

    token = os.environ.get(token_env, "").strip()   # as the gateway reads it (a secret file's newline)
    if not token:
        print(f"{command}: set {token_env} to the gateway's admin token", file=sys.stderr)
        return 2, None
    try:
        r = httpx.request(method, url.rstrip("/") + path, params=params, json=body,
                          headers={"authorization": f"Bearer {token}"}, timeout=30)
    except httpx.HTTPError as e:
        print(f"{command}: cannot reach {url}: {e}", file=sys.stderr)
        return 1, None
    try:
        data = r.json()
    except ValueError:
        data = r.text
    if r.status_code >= 400:
        msg = data.get("error", {}).get("message") if isinstance(data, dict) else data
        print(f"{command}: {r.status_code}: {msg}", file=sys.stderr)
        return 1, None
    return 0, data
