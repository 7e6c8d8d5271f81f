"""The engine core's threads follow the machine's load (engine/worker/cpu_threads.py): the load read from
``/proc/stat`` and this process's CPU time, the count it gives, and the engine's outputs, bitwise the same
whatever the threads of each step (real SmolLM2)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker import cpu_threads, model_runner
from engine.worker.cpu_threads import LoadFollowingThreads, busy_seconds, follow_load, threads_for

STAT = """cpu  900 90 900 9000 90 9 9 9 0 0
cpu0 100 10 100 1000 10 1 1 1 0 0
cpu1 200 20 200 2000 20 2 2 2 0 0
cpu2 400 40 400 4000 40 4 4 4 50 0
intr 12345 0 0
ctxt 999
"""


def test_busy_time_is_every_field_but_idle_and_iowait_of_the_cpus_given():
    # cpu0: 100 + 10 + 100 + 1 + 1 + 1 ticks; cpu2: 400 + 40 + 400 + 4 + 4 + 4 (guest is inside user)
    assert busy_seconds(STAT, {0, 2}, 0.01) == pytest.approx((213 + 852) * 0.01)
    assert busy_seconds(STAT, {1}, 0.5) == pytest.approx(426 * 0.5)
    assert busy_seconds(STAT, {7}, 0.01) == 0


@pytest.mark.parametrize("cores, others, threads", [(2, 0.0, 2), (2, 0.45, 2), (2, 0.5, 1), (2, 1.0, 1),
                                                    (2, 5.0, 1), (4, 1.2, 3), (4, 2.6, 1), (1, 0.0, 1)])
def test_a_step_gets_the_cores_the_others_leave(cores, others, threads):
    assert threads_for(cores, others) == threads


class _Machine:
    """A fake clock, /proc/stat and process CPU time: each ``run(seconds, ours, others)`` advances them as
    if this process had used ``ours`` cores and the other processes ``others``, on CPUs 0 and 1."""

    def __init__(self):
        self.t = self.cpu = 0.0
        self.ticks = [0, 0]
        self.readable = True

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.t += seconds
        self.cpu += ours * seconds
        busy = round((ours + others) * seconds * 100)
        self.ticks = [self.ticks[0] + busy // 2, self.ticks[1] + busy - busy // 2]

    def stat(self) -> str:
        if not self.readable:
            raise OSError("/proc/stat: gone")
        return "".join(f"cpu{i} {b} 0 0 0 0 0 0 0 0 0\n" for i, b in enumerate(self.ticks))


def test_the_threads_drop_while_other_processes_run_and_come_back(monkeypatch):
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    m, set_to = _Machine(), []
    gov = LoadFollowingThreads(2, {0, 1}, read_stat=m.stat, cpu_time=lambda: m.cpu, clock=lambda: m.t,
                               set_threads=set_to.append)
    m.run(0.3, ours=2.0, others=0.0)
    assert gov.apply() == 2 and set_to == []            # a quiet machine: every core
    m.run(0.3, ours=1.2, others=0.8)
    assert gov.apply() == 1 and set_to == [1]           # another process took most of a core
    m.run(0.1, ours=1.0, others=0.0)
    assert gov.apply() == 1 and set_to == [1]           # under SAMPLE_S since the last sample: unchanged
    m.run(0.3, ours=1.0, others=1.0)
    assert gov.apply() == 1 and set_to == [1]           # it still runs: one thread
    m.run(0.3, ours=1.0, others=0.1)
    assert gov.apply() == 2 and set_to == [1, 2]        # it stopped: both again
    one = LoadFollowingThreads(1, {0, 1}, read_stat=m.stat, cpu_time=lambda: m.cpu, clock=lambda: m.t,
                               set_threads=set_to.append)
    m.run(0.3, ours=1.0, others=0.0)
    assert one.apply() == 1                             # never above the engine's own count
    m.readable = False
    m.run(0.3, ours=1.0, others=2.0)
    assert gov.apply() == 2 and set_to == [1, 2]        # /proc/stat unreadable for a moment: kept
    m.readable = True
    m.run(0.3, ours=1.0, others=2.0)
    assert gov.apply() == 1 and set_to == [1, 2, 1]     # readable again: the load seen since the last sample


def test_a_window_over_an_idle_engine_says_nothing_of_the_load_now(monkeypatch):
    """Another process ran while the engine waited for work (a benchmark's peer between two rounds) and has
    ended: the engine's next steps keep the count it had, and the next window, fresh, decides."""
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    m, set_to = _Machine(), []
    gov = LoadFollowingThreads(2, {0, 1}, read_stat=m.stat, cpu_time=lambda: m.cpu, clock=lambda: m.t,
                               set_threads=set_to.append)
    m.run(0.3, ours=2.0, others=0.0)
    assert gov.apply() == 2
    m.run(5.0, ours=0.0, others=2.0)                    # idle engine, a peer on both cores, then it exits
    assert gov.apply() == 2 and set_to == []            # stale: kept
    m.run(0.3, ours=2.0, others=0.0)
    assert gov.apply() == 2 and set_to == []            # the fresh window: quiet
    m.run(cpu_threads.STALE_S + 0.1, ours=0.0, others=1.5)
    assert gov.apply() == 2                             # stale again
    m.run(0.3, ours=1.0, others=1.0)
    assert gov.apply() == 1 and set_to == [1]           # a fresh window that sees the other process: one thread


def test_only_a_cpu_engine_without_a_fixed_count_follows_the_load(monkeypatch):
    assert isinstance(follow_load("cpu", None), LoadFollowingThreads)
    assert follow_load("cpu", None).max_threads == torch.get_num_threads()
    assert follow_load("cpu", 2) is None and follow_load("cuda", None) is None
    monkeypatch.delattr(cpu_threads.os, "sched_getaffinity")   # not Linux
    assert follow_load("cpu", None) is None


def _outputs(llm: LLM, prompts: list[list[int]]) -> list:
    """Greedy token ids with their top logprobs, and a seeded sampled request's, exactly."""
    params = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)] * (len(prompts) - 1)
    params.append(SamplingParams(temperature=0.8, seed=5, max_tokens=12, logprobs=2, ignore_eos=True))
    return [[(t, tuple(sorted((k, v.logprob) for k, v in lp.items())))
             for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in llm.generate(prompts, params)]


class _Alternating:
    """Stands in for follow_load's LoadFollowingThreads: one thread, then two, step after step."""

    def __init__(self):
        self.steps = 0

    def apply(self) -> int:
        self.steps += 1
        torch.set_num_threads(1 + self.steps % 2)
        return torch.get_num_threads()


def test_the_load_is_read_over_the_process_cpus_not_the_bound_thread(monkeypatch):
    """Once OpenMP binds the model's threads (device.choose_omp_binding), the core's initial thread may run on
    one CPU: the follower still counts every CPU the process was given (TANDEM_CPUS), else a quiet 2-core
    machine gave a request one thread (a trial: 85 tok/s where 2 threads gave 141)."""
    import os
    import threading

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU here")
    monkeypatch.setenv("TANDEM_CPUS", ",".join(map(str, cpus)))
    seen = {}

    def bound_thread():   # as libgomp leaves the initial thread: pinned to its place
        os.sched_setaffinity(0, cpus[:1])
        seen["cpus"] = LoadFollowingThreads(len(cpus), set_threads=lambda n: None).cpus

    t = threading.Thread(target=bound_thread)
    t.start()
    t.join()
    assert seen["cpus"] == set(cpus)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_the_outputs_do_not_depend_on_the_threads_of_each_step(monkeypatch, quantization):
    """One prompt of 100 tokens (prefill through the per-operation path, then one-row steps in the one-region
    decode stack), then three and four of 5-100 (decode steps of 3 and 4 rows), on two threads throughout and
    with the count changing every step;
    the GGUF's weights dequantized to bfloat16 (with their 4-bit copies for decode) or kept in 4 bits."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fixed = LLM(dtype="bfloat16", kv_cache_memory="64MiB", quantization=quantization, num_threads=2)
        prompts = [list(range(1000, 1100)), list(range(200, 205)), list(range(3000, 3040)), list(range(7, 27))]
        want = [_outputs(fixed, ps) for ps in ([prompts[0]], prompts[:3], prompts)]
        monkeypatch.setattr(model_runner, "follow_load", lambda device_type, num_threads: _Alternating())
        torch.set_num_threads(2)
        changing = LLM(dtype="bfloat16", kv_cache_memory="64MiB", quantization=quantization)
        got = [_outputs(changing, ps) for ps in ([prompts[0]], prompts[:3], prompts)]
        assert changing.engine.model_runner.cpu_threads.steps >= 36
    finally:
        torch.set_num_threads(threads)
    assert got == want
