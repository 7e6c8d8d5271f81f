"""The engine core's loop, and the entry point of the engine core process.

``run_core_loop`` drives an ``EngineCore``: take the pending commands (block
while idle), apply them, run one step, and emit one ``CoreStep`` (the step's
outputs batched with the stats). ``engine/core/core_client.py`` runs it in a
thread of the front end's process or, with ``run_engine_core_process``, in a
child process of its own (vLLM v1's ``EngineCoreProc``): the front end keeps
HTTP, tokenization and output processing, so the model step never shares a
GIL with the event loop.

The child dies with its parent: a reader thread blocks on the pipe, and the
pipe's end of file (the parent exited, even by SIGKILL) ends the process.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.core.core_messages import (AbortRequests, AddRequest, Command, CompileGrammar, CoreFailed, CoreReady,
                                  CoreReply, CoreStep, EmbedPrompts, FinishSequences, Reply, Shutdown, decode_command,
                                  Withdraw, encode, params_from_wire, spec_from_wire)
from engine.worker.device import unbind_thread

logger = logging.getLogger("tandem.engine_core")


def run_core_loop(core, take_commands: Callable[[bool], list[Command]], emit: Callable[[Reply], None]) -> None:
    """Serve commands and step until ``Shutdown`` (then abort what is left).

    Args:
        core: an ``EngineCore``.
        take_commands: ``take_commands(block)`` returns the pending commands,
            waiting for at least one when ``block`` (the core is idle).
        emit: receives one ``CoreStep`` per iteration.

    A step that raises fails only its in-flight requests (``CoreStep.failed``),
    unless the engine cannot step again (``core.failure``: a tensor-parallel
    rank died); that and any other exception end the loop and propagate.
    """
    while True:
        rejected: list[tuple[str, str, str]] = []
        acks: list[int] = []
        stop = False
        for cmd in take_commands(not core.has_unfinished_requests()):
            if isinstance(cmd, AddRequest):
                try:
                    core.add_request(cmd.request_id, cmd.prompt_token_ids, params_from_wire(cmd.params),
                                     priority=cmd.priority, arrival_time=cmd.arrival_time, resume=cmd.resume,
                                     cache_salt=cmd.cache_salt)
                except Exception as exc:  # noqa: BLE001 - goes to that request only
                    rejected.append((cmd.request_id, type(exc).__name__, str(exc)))
            elif isinstance(cmd, AbortRequests):
                core.abort_requests(cmd.request_ids)
                if cmd.ack is not None:
                    acks.append(cmd.ack)
            elif isinstance(cmd, FinishSequences):
                core.finish_sequences(cmd.stops)
            elif isinstance(cmd, EmbedPrompts):
                try:
                    core.add_embed(cmd.call_id, cmd.prompts, cmd.pooling_type or None, cmd.normalize)
                except Exception as exc:  # noqa: BLE001 - goes to that call only
                    emit(CoreReply(cmd.call_id, error=str(exc) or type(exc).__name__))
            elif isinstance(cmd, Withdraw):
                emit(CoreReply(cmd.call_id, value=list(core.withdraw(cmd.request_id, cmd.by, cmd.scale,
                                                                     cmd.arrival_tok_s))))
            elif isinstance(cmd, Shutdown):
                stop = True
        if stop:
            core.abort_all()
            emit(CoreStep([], core.get_stats(), time.monotonic(), rejected=rejected, acks=acks))
            emit_embeds(core, emit)
            core.close()
            return
        outputs, failed, error = [], [], None
        if core.has_unfinished_requests():
            try:
                outputs = core.step()
            except Exception as exc:  # noqa: BLE001 - fail the in-flight requests, keep the loop
                failed = core.abort_all()
                logger.exception("engine step failed; aborting %d in-flight request(s)", len(failed))
                error = f"{type(exc).__name__}: {exc}"
                if core.failure is not None:
                    emit(CoreStep([], core.get_stats(), time.monotonic(), failed=failed, error=error))
                    raise
        emit(CoreStep(outputs, core.get_stats(), time.monotonic(), rejected=rejected, failed=failed,
                      error=error, acks=acks))
        emit_embeds(core, emit)


def emit_embeds(core, emit: Callable[[Reply], None]) -> None:
    """Answer each ``EmbedPrompts`` whose pooling requests have all run (``EngineCore.take_embeds``): its
    vectors, or the error that aborted it."""
    for call_id, vectors, error in core.take_embeds():
        emit(CoreReply(call_id, value=vectors) if error is None else CoreReply(call_id, error=error, status=503))


def ready_message(core) -> CoreReady:
    """What the front end needs to know of a loaded core."""
    return CoreReady(served_model_name=core.served_model_name, max_model_len=core.max_model_len,
                     num_blocks=core.num_blocks, vocab_size=core.model_config.vocab_size, stats=core.get_stats(),
                     system_fingerprint=core.system_fingerprint)


def start_engine_core(args, bind_threads: bool = False):
    """An ``EngineCore`` for ``args`` (the model loaded) in this process, whose OpenMP wait policy is chosen
    first (``choose_omp_wait_policy``: before torch loads libgomp, which importing the core does) and whose
    malloc keeps freed memory up to its thresholds, NumPy's huge pages off (``tune_malloc``: a grammar compile's
    memory churn and ``khugepaged`` stalled the step). What every
    starter of a core calls: the core process's entry, ``ThreadCoreClient.start`` and ``LLMEngine``.
    ``bind_threads``: also bind OpenMP's threads one per core (``choose_omp_binding``); only the core
    process's entry, whose initial thread is the model's.

    Raises:
        ValueError: a bad ``TANDEM_CPU_WAIT_POLICY``; and whatever ``EngineCore(args)`` raises
            (FileNotFoundError, ValueError, MemoryError).
    """
    from engine.worker.device import choose_omp_binding, choose_omp_wait_policy, pin_rank_cpus
    from engine.worker.malloc_tuning import tune_malloc

    tune_malloc()
    choose_omp_wait_policy()   # both no-ops once torch is loaded
    if bind_threads and args.tensor_parallel_size > 1:
        pin_rank_cpus(args, 0)   # the driver rank's share of the cores; the others' go to its ranks
    elif bind_threads:
        choose_omp_binding()
    from engine.core.engine_core import EngineCore  # heavy import (torch)

    return EngineCore(args)


def run_engine_core_process(args, conn) -> None:
    """Entry point of the engine core process (multiprocessing "spawn").

    Loads the model (``CoreFailed`` on error, then exits), sends
    ``CoreReady``, then runs ``run_core_loop`` with commands read from
    ``conn`` by a reader thread; grammar validations and compilations run
    in the core's grammar pool (``engine/worker/grammar_compiler.py``) and are
    answered with ``CoreReply``. Exits when the loop ends
    (``Shutdown``) or the parent's end of ``conn`` closes.
    """
    # Ctrl-C and `kill -- -<pgid>` reach the whole process group: the front end
    # shuts the core down (or closes the pipe, which ends it); a signal here
    # would only print a traceback and look like a crash to the front end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    send_lock = threading.Lock()

    def emit(msg: Reply) -> None:
        data = encode(msg)
        with send_lock:
            conn.send_bytes(data)

    try:
        core = start_engine_core(args, bind_threads=True)   # torch: only in this process
    except BaseException as exc:  # noqa: BLE001 - reported to the front end
        emit(CoreFailed(type(exc).__name__, str(exc)))
        return
    emit(ready_message(core))
    core.on_failure(lambda reason: os._exit(1))   # a rank died (logged): the front end sees this process end
    commands: queue.SimpleQueue = queue.SimpleQueue()
    # Hands compiles to the core's grammar pool (the first one builds the manager: seconds), so that the
    # reader never waits; validation and compiles run in the pool's workers.
    submitter = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar-submit", initializer=unbind_thread)
    # Build the grammar manager (xgrammar import, the tokenizer's vocabulary table: Python work that holds
    # the GIL for a while) now, while the engine is idle, not under the first structured request while
    # other streams run; its objects are then frozen out of the garbage collector's full collections.
    submitter.submit(core.prepare_structured_outputs)

    def compile_grammar(cmd: CompileGrammar) -> None:
        def done(digest: str, error) -> None:
            if error is None:
                emit(CoreReply(cmd.call_id, digest=digest))
            else:
                emit(CoreReply(cmd.call_id, error=str(error) or type(error).__name__,
                               status=getattr(error, "status", 400)))
        try:
            core.submit_grammar(spec_from_wire(cmd.spec), done)
        except Exception as exc:  # noqa: BLE001 - the front end raises it
            done("", exc)

    def read() -> None:
        unbind_thread()
        try:
            while True:
                cmd = decode_command(conn.recv_bytes())
                if isinstance(cmd, CompileGrammar):
                    submitter.submit(compile_grammar, cmd)
                else:
                    commands.put(cmd)
        except (EOFError, OSError):  # the front end is gone: so are we
            os._exit(0)

    threading.Thread(target=read, name="tandem-core-reader", daemon=True).start()
    run_core_loop(core, lambda block: take_all(commands, block), emit)
    # Ended and closed: exit now. Returning would join the grammar pool's threads (multiprocessing's
    # threading._shutdown), and a compile xgrammar cannot interrupt held the exit: a trial's gateway took
    # 30-45 s to stop after a schema's compile ran past its timeout.
    logging.shutdown()
    os._exit(0)


def take_all(commands: queue.SimpleQueue, block: bool) -> list:
    """Everything queued in ``commands``; with ``block``, wait for one first."""
    cmds = [commands.get()] if block else []
    while True:
        try:
            cmds.append(commands.get_nowait())
        except queue.Empty:
            return cmds
