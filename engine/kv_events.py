"""KV-cache events in vLLM's wire format, for KV-aware routers (llm-d's indexer, SGLang's and vLLM's routers).

The engine publishes what enters and leaves its prefix cache, as vLLM does with ``--kv-events-config``
(``vllm/distributed/kv_events.py``, ``vllm/config/kv_events.py``; subscriber example
``examples/online_serving/kv_events_subscriber.py``):

* a ZMQ PUB socket sends one multipart message per engine step that changed the cache:
  ``[topic, seq (8 bytes, big-endian), payload]``, the payload a msgpack ``KVEventBatch``;
* an optional ROUTER socket (``replay_endpoint``) answers a start sequence number (8 bytes, big-endian) with
  ``[seq, payload]`` for every buffered batch from there, then ``[-1 as 8 signed bytes, b""]``. Ask from a DEALER
  socket (frames ``[b"", start]``): a REQ socket, as in vLLM's example, keeps only the first of those replies.

Structs are msgspec's with vLLM's field order and options (``array_like``, ``tag``: an event is encoded as
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``). Block hashes
are the low 64 bits (last 8 bytes, big-endian) of the engine's sha256 block hash, as vLLM sends them by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); ``medium`` is ``"GPU"``, vLLM's name for the engine's own KV pool
whatever the device. The publisher never slows a step: ``publish`` only enqueues (a full queue drops the batch
and counts it), a thread encodes and sends, and the PUB socket drops for a subscriber past its high-water mark
(it can ask the replay socket for what it missed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.json_config import config_object

logger = logging.getLogger("tandem.kv_events")

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events. ``ts``: wall-clock seconds (``time.time()``)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the KV-cache events (vLLM's tagged union)."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one sequence entered the prefix cache.

    ``block_hashes``: one 64-bit hash per block, in sequence order; ``parent_block_hash``: the hash of the block
    before the first one (None at the sequence's start); ``token_ids``: the blocks' tokens, ``block_size`` each,
    concatenated; ``lora_id``: None (no adapters); ``medium``: ``"GPU"``.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted to make room)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block was dropped."""


class KVEventBatch(EventBatch):
    """The payload of one PUB message."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(block_hash: bytes) -> int:
    """The 64-bit hash a subscriber sees for an engine block hash (32-byte sha256 digest): its last 8 bytes,
    big-endian, as vLLM's ``maybe_convert_block_hash``."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (same keys and defaults).

    Attributes:
        enable_kv_cache_events: publish at all.
        publisher: "zmq" or "null"; None means "zmq" when enabled, else "null" (as vLLM).
        endpoint: the PUB socket; bound when it holds ``*``, ``::``, ``ipc://`` or ``inproc://``, else connected.
        replay_endpoint: the ROUTER socket for replays (bound), or None.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's send high-water mark (messages per subscriber).
        max_queue_size: batches waiting for the publisher thread; past it a batch is dropped (and counted).
        topic: the first frame of every message.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be zmq or null, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def parse(cls, value: dict | str | None) -> KVEventsConfig | None:
        """A config from a dict or its JSON text (``--kv-events-config``); None when absent or not publishing.

        Raises:
            ValueError: not JSON, not an object, an unknown key (named) or a bad value.
        """
        if value is None:
            return None
        value = config_object(value, "kv_events_config", cls)
        config = cls(**value)
        return config if config.enable_kv_cache_events and config.publisher == "zmq" else None


class ZmqEventPublisher:
    """PUB + optional ROUTER replay publisher on a thread of its own (vLLM's ``ZmqEventPublisher``).

    ``publish`` is called from the engine step and only enqueues. ``dropped``: batches refused because the
    queue was full (their sequence numbers are never used, so subscribers see no gap they could replay)."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq  # only an engine that publishes needs pyzmq

        self._zmq = zmq
        self.config = config
        self.dropped = 0
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Queue one batch (never blocks). Its ``data_parallel_rank`` is set to 0 when unset, as vLLM's."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: publisher queue full, %d batch(es) dropped so far", self.dropped)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), stop the thread and close the sockets."""
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad request must not stop publishing
                    logger.exception("KV events: replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload), flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                pass  # no room for some subscriber: it replays from the buffer
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def take_batch(pending: list, now: float | None = None) -> KVEventBatch | None:
    """The batch of ``pending`` events (emptied), or None when there are none. ``now``: ``time.time()``."""
    if not pending:
        return None
    batch = KVEventBatch(ts=time.time() if now is None else now, events=list(pending))
    pending.clear()
    return batch
