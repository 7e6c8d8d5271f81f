"""KV-cache events in vLLM's wire format (``engine/kv_events.py``), read by a subscriber written after vLLM's
published example (``examples/online_serving/kv_events_subscriber.py``): its own msgspec structs with the same
field order, a SUB socket for the stream and a REQ socket for replays."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import msgspec
import pytest

from engine.core.kv_cache_manager import hash_block_tokens
from engine.kv_events import KVEventsConfig, external_block_hash
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.entrypoints.test_serving import cli_server
from tests.tiny_models import save_byte_level_llama

zmq = pytest.importorskip("zmq")
BLOCK = 16


# The subscriber's side, as vLLM's example declares it (not imported from the engine: the wire is the contract).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    """SUB on ``endpoint`` (topic ``topic``) and REQ on ``replay``; ``read`` takes what has arrived."""

    def __init__(self, endpoint: str, replay: str, topic: str, hwm: int = 0) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        if hwm:
            self.sub.set_hwm(hwm)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay_endpoint = replay

    def read(self, quiet_s: float = 0.5) -> list[tuple[int, KVEventBatch]]:
        out = []
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
        return out

    def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        """Batches from ``start`` on. A DEALER, not the example's REQ: a REQ socket takes one reply per request,
        and the replay answers with one message per batch."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        try:
            while True:
                assert dealer.poll(10_000), "no replay answer"
                _, seq, payload = dealer.recv_multipart()
                if not payload:
                    assert int.from_bytes(seq, "big", signed=True) == -1
                    return out
                out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def config(tmp_path, name: str, **kw) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/{name}.pub",
            "replay_endpoint": f"ipc://{tmp_path}/{name}.replay", "topic": "kv-events", **kw}


def chain(token_ids: list[int]) -> dict[int, tuple[int | None, list[int]]]:
    """external hash -> (external parent hash, the block's tokens) for every full block of ``token_ids``."""
    out, parent = {}, None
    for i in range(len(token_ids) // BLOCK):
        tokens = token_ids[i * BLOCK:(i + 1) * BLOCK]
        h = hash_block_tokens(parent, tokens)
        out[external_block_hash(h)] = (None if parent is None else external_block_hash(parent), tokens)
        parent = h
    return out


def replay_state(batches, known: dict) -> set[int]:
    """Apply the batches in order to an empty cache, checking each event against the engine's rules: a block
    is stored only when absent, removed only when present, and carries the tokens and parent it was hashed from."""
    cached: set[int] = set()
    for _, batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK and ev.medium == "GPU" and ev.lora_id is None
                assert len(ev.token_ids) == BLOCK * len(ev.block_hashes)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert h not in cached, "stored twice without a removal"
                    assert known[h] == (parent, ev.token_ids[i * BLOCK:(i + 1) * BLOCK]), "wrong tokens or parent"
                    cached.add(h)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in cached, "removed a block never stored"
                    cached.remove(h)
            else:
                cached.clear()
    return cached


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_byte_level_llama(tmp_path_factory.mktemp("tiny-kv-events"))


def run_workload(llm: LLM, seed: int, n: int = 24) -> dict:
    """Multi-turn-like prompts (shared prefixes) that overflow a small pool; returns ``chain`` of every
    sequence computed (prompt + output tokens)."""
    rng = random.Random(seed)
    stems = [[rng.randrange(2, 200) for _ in range(40)] for _ in range(4)]
    known: dict = {}
    prompts = [rng.choice(stems) + [rng.randrange(2, 200) for _ in range(rng.randrange(5, 60))] for _ in range(n)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(0, n, 6):
        batch = prompts[i:i + 6]
        for p, out in zip(batch, llm.generate(batch, params)):
            known.update(chain(p + list(out.outputs[0].token_ids)))
    return known


def test_every_stored_and_evicted_block_is_published_once_in_order_and_replayable(tiny_model, tmp_path):
    cfg = config(tmp_path, "a")
    llm = LLM(tiny_model, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=40, kv_events_config=cfg)
    sub = Subscriber(cfg["endpoint"], cfg["replay_endpoint"], cfg["topic"])
    time.sleep(0.3)  # PUB/SUB: a subscriber sees what is sent after it joined
    try:
        known = run_workload(llm, seed=1)
        got = sub.read()
        seqs = [s for s, _ in got]
        assert seqs == list(range(len(seqs))) and len(seqs) > 5
        events = [e for _, b in got for e in b.events]
        assert any(isinstance(e, BlockRemoved) for e in events), "the pool was meant to overflow"
        pool = llm.engine.core.scheduler.kv_cache_manager.block_pool
        assert replay_state(got, known) == {external_block_hash(h) for h in pool.cached_block_hash_to_block}
        # replay: everything from 0, and a tail from the middle, byte for byte what was published
        assert sub.replay(0) == got
        mid = len(got) // 2
        assert sub.replay(mid) == got[mid:]
        assert llm.engine.core.kv_event_publisher.dropped == 0
    finally:
        sub.close()
        llm.engine.core.close()


def test_a_late_or_stalled_subscriber_recovers_everything_by_replay(tiny_model, tmp_path):
    """A subscriber that joins late misses batches and gets them back from the replay socket; one that never
    reads (receive HWM 1) holds up nothing: the steps run, no batch is dropped by the publisher."""
    cfg = config(tmp_path, "b", hwm=2)
    llm = LLM(tiny_model, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=40, kv_events_config=cfg)
    stalled = Subscriber(cfg["endpoint"], cfg["replay_endpoint"], cfg["topic"], hwm=1)
    late = None
    try:
        known = run_workload(llm, seed=2, n=12)         # nobody reads these
        late = Subscriber(cfg["endpoint"], cfg["replay_endpoint"], cfg["topic"])
        time.sleep(0.3)
        known.update(run_workload(llm, seed=3, n=12))
        got = late.read()
        assert got and got[0][0] > 0                     # it missed the first batches ...
        replayed = late.replay(0)
        # what it read is in the replay at its own seqs: it may stop reading before the last, and PUB/SUB may drop
        # batches on the way to it when its queue is full (the publisher's send HWM is 2 here): the replay has them
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert [s for s, _ in got] == sorted({s for s, _ in got}) and all(replayed[s] == (s, b) for s, b in got)
        pool = llm.engine.core.scheduler.kv_cache_manager.block_pool
        assert replay_state(replayed, known) == {external_block_hash(h) for h in pool.cached_block_hash_to_block}
        assert llm.engine.core.kv_event_publisher.dropped == 0
    finally:
        stalled.close()
        if late is not None:
            late.close()
        llm.engine.core.close()


def test_config_is_vllms_and_bad_input_is_named():
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    cfg = KVEventsConfig.parse({"enable_kv_cache_events": True})
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.topic) == (
        "zmq", "tcp://*:5557", None, 10_000, 100_000, "")
    for bad, word in [("{", "JSON"), ("[1]", "object"), ('{"enable_kv_cache_events": true, "port": 1}', "unknown key.*port"),
                      ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
                      ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm")]:
        with pytest.raises(ValueError, match=word):
            KVEventsConfig.parse(bad)


@pytest.mark.slow
def test_two_served_replicas_publish_their_own_cache(tmp_path):
    """Two ``tandem engine serve`` processes (SmolLM2) with KV events on: each replica's stream holds exactly
    the blocks of the prompts it served, with their token ids."""
    cfgs = [config(tmp_path, f"r{i}") for i in range(2)]
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 20000) for _ in range(70)] for _ in range(4)]
    with cli_server("--kv-events-config", json.dumps(cfgs[0]), "--max-model-len", "512") as (_, base0, _out0), \
            cli_server("--kv-events-config", json.dumps(cfgs[1]), "--max-model-len", "512") as (_, base1, _out1):
        subs = [Subscriber(c["endpoint"], c["replay_endpoint"], c["topic"]) for c in cfgs]
        try:
            time.sleep(0.3)
            known: list[dict] = [{}, {}]
            for i, p in enumerate(prompts):
                r = httpx.post(f"{(base0, base1)[i % 2]}/v1/completions", timeout=120, json={
                    "model": "SmolLM2-135M-Instruct", "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                known[i % 2].update(chain(p))
            for k, sub in enumerate(subs):
                got = sub.read(quiet_s=1.0)
                assert [s for s, _ in got] == list(range(len(got))) and sub.replay(0) == got
                stored = replay_state(got, known[k])   # 70-token prompts, 4 new tokens: every full block is prompt
                assert set(known[k]) <= stored          # every full prompt block of its own prompts
                assert not set(known[1 - k]) & stored   # none of the other replica's
        finally:
            for sub in subs:
                sub.close()

