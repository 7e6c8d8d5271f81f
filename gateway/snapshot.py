"""One config generation as the request path reads it (``Gateway.snapshot``, swapped whole by
``gateway/runtime.py``): the compiled config, its backends, its version, and what the hot path derives from them
once (who may call it, which signals the policy reads)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.backends.local import LocalBackend
from gateway.config.compile import Compiled
from gateway.errors import ClientError
from gateway.request.auth import authenticate, foreign_caller
from policies import Signals


@dataclass
class Snapshot:
    """One immutable config generation as the hot path uses it."""

    compiled: Compiled
    backends: dict
    version: int
    source: str
    needs_prompt_tokens: bool
    max_body_size: int
    local: LocalBackend | None = None
    warnings: list[str] = field(default_factory=list)
    needs_local_signals: bool = False
    owners: dict[str, str] = field(default_factory=dict)   # ``ConfigState.owners`` of the running version
    closed: bool = False     # no key left on an exposed listener: every request refused (``exposed_without_keys``)
    this_machine_only: bool = False   # keyless on loopback: browsers' foreign calls refused (``foreign_caller``)

    @property
    def keyed(self) -> bool:
        """Whether callers are told apart (virtual keys, or none left on an exposed listener): the operational
        details (``/metrics``, ``/health/ready``'s backends) are then the admin token's, not every caller's."""
        return bool(self.compiled.key_hashes) or self.closed

    def authenticate(self, headers: Mapping[str, str], api: str = "openai") -> str:
        """The tenant of a request (its lower-case ``headers``) under this generation's keys: its
        ``Authorization`` header's (``authenticate``; ``api``: whose header its 401 names), and on a keyless
        loopback gateway only a local caller's (``foreign_caller``). Raises ClientError 401, or 403."""
        self.check_local(headers)
        return authenticate(headers.get("authorization"), self.compiled.key_hashes, self.closed, api)

    def check_local(self, headers: Mapping[str, str]) -> None:
        """On a keyless loopback gateway (``this_machine_only``), refuse a caller that is not this machine's: a
        browser page of another site (``foreign_caller``). Raises ClientError 403 ``foreign_origin``."""
        if self.this_machine_only and (why := foreign_caller(headers.get("host"), headers.get("origin"),
                                                             self.cors_origins)):
            raise ClientError(403, why, code="foreign_origin")

    @functools.cached_property
    def cors_origins(self) -> tuple[str, ...]:
        """The origins ``server.cors`` allows (read once per generation, not per request)."""
        cors = self.compiled.config.server.cors
        return tuple(cors.allow_origins) if cors is not None else ()

    def signals(self) -> Signals:
        """Live signals for the policy: local engine load (only when a rule
        looks at it) and the backends that cannot be used now."""
        unavailable = {n: b.unavailable_reason for n, b in self.backends.items() if not b.available}
        if self.needs_local_signals and self.local is not None:
            waiting, running, kv = self.local.stats()
            return Signals(waiting, running, kv, unavailable)
        return Signals(unavailable=unavailable)
