"""Stored Responses (``store: true``, the Responses API's default): what ``previous_response_id``, ``GET`` /
``DELETE /v1/responses/{id}`` and ``input_items`` read.

One record per response: the tenant that made it (another tenant is told it does not exist), the response
object, this turn's input items, and the conversation before them (``history``: the previous response's
history, input and output), so a turn's whole context is one read however long the chain.

With ``state.redis_url`` the records live in Redis (``<prefix>:response:<id>``, expiring after ``TTL_S``) and
every replica reads them; without it, or while Redis is unreachable (``gateway/state.py``'s fallback), in this
process, each for ``TTL_S``, and per tenant: at most ``MAX_IN_PROCESS`` records and ``MAX_BYTES_IN_PROCESS`` bytes
of records, the tenant's least recently stored dropped first (its newest is always kept). One tenant's records never
push out another's (a security trial's tenant evicted another's conversations with 10,050 cached answers).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from gateway.state import SharedState

TTL_S = 30 * 24 * 3600          # OpenAI keeps stored responses 30 days
# bound the memory of a gateway without Redis, per tenant (a record holds a conversation)
MAX_IN_PROCESS = 10_000
MAX_BYTES_IN_PROCESS = 256 * 2**20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: ``tenant``, the ``response`` object, this turn's ``input`` items, the ``history``
    (items) before them."""

    tenant: str
    response: dict
    input: list
    history: list

    def conversation(self) -> list[dict]:
        """The items a follow-up (``previous_response_id``) continues from: history, input, output."""
        return [*self.history, *self.input, *self.response.get("output", [])]


class ResponseStore:
    """Stored responses on ``state`` (Redis, or in process as described above)."""

    def __init__(self, state: SharedState, ttl_s: float = TTL_S, max_in_process: int = MAX_IN_PROCESS,
                 max_bytes_in_process: int = MAX_BYTES_IN_PROCESS):
        self.state, self.ttl_s = state, ttl_s
        self.max_in_process, self.max_bytes_in_process = max_in_process, max_bytes_in_process
        # in process: tenant -> (id -> (expiry, record JSON), least recently stored first), and its records' bytes
        self._tenants: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._bytes: dict[str, int] = {}

    def _key(self, response_id: str) -> str:
        return self.state.key("response", response_id)

    def _put_memory(self, tenant: str, response_id: str, data: bytes) -> None:
        self._drop_memory(tenant, response_id)
        ids = self._tenants.setdefault(tenant, OrderedDict())
        ids[response_id] = (time.monotonic() + self.ttl_s, data)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + len(data)
        while len(ids) > 1 and (len(ids) > self.max_in_process or self._bytes[tenant] > self.max_bytes_in_process):
            self._drop_memory(tenant, next(iter(ids)))

    def _drop_memory(self, tenant: str, response_id: str) -> None:
        entry = self._tenants.get(tenant, {}).pop(response_id, None)
        if entry is not None:
            self._bytes[tenant] -= len(entry[1])

    def _get_memory(self, response_id: str, tenant: str) -> bytes | None:
        entry = self._tenants.get(tenant, {}).get(response_id)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            self._drop_memory(tenant, response_id)
            return None
        return entry[1]

    async def put(self, record: StoredResponse) -> None:
        """Store ``record`` under its response's id."""
        rid, data = record.response["id"], msgspec.json.encode(record)
        await self.state.call(lambda r: r.set(self._key(rid), data.decode(), ex=int(self.ttl_s)),
                              lambda: self._put_memory(record.tenant, rid, data))

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The record of ``response_id`` made by ``tenant``; None when there is none (expired, deleted, never
        stored, or another tenant's)."""
        data = await self.state.call(lambda r: r.get(self._key(response_id)),
                                     lambda: self._get_memory(response_id, tenant))
        if data is None:
            return None
        record = msgspec.json.decode(data, type=StoredResponse)
        return record if record.tenant == tenant else None

    async def delete(self, response_id: str, tenant: str) -> bool:
        """Delete ``tenant``'s record of ``response_id``; False when there was none."""
        if await self.get(response_id, tenant) is None:
            return False
        await self.state.call(lambda r: r.delete(self._key(response_id)),
                              lambda: self._drop_memory(tenant, response_id))
        return True
