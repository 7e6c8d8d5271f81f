"""How the front end (``AsyncEngine``) reaches the engine core: in a thread
of this process, or in a child process of its own.

Both clients offer the same five calls: ``start(on_step, on_dead)`` (blocking:
loads the model; call it from a worker thread), ``send(command)``,
``compile_grammar(spec)`` (a coroutine), ``shutdown()`` (blocking) and
``is_alive()``. ``on_step(CoreStep)`` is called for each iteration of the
core loop, from one thread (the engine thread, or the process client's
reader thread); ``on_dead(reason)`` once, when the core loop ended (shut
down, crashed, or its process died).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable

import msgspec

from engine.core.core_loop import (ready_message, run_core_loop, run_engine_core_process, start_engine_core,
                                   take_all)
from engine.core.core_messages import (AbortRequests, Command, CompileGrammar, CoreFailed, CoreReady, CoreReply, CoreStep,
                                  EmbedPrompts, Shutdown, Withdraw, decode_reply, embed_request_ids, encode,
                                  params_to_wire, rebuild_error)
from engine.worker.grammar_compiler import GrammarRefused

logger = logging.getLogger("tandem.core_client")

OnStep = Callable[[CoreStep], None]
OnDead = Callable[[str], None]


class ThreadCoreClient:
    """The core loop in a daemon thread of this process (``engine_core_process: false``).

    Attributes:
        core: the ``EngineCore`` once started (tests patch its ``step``).
    """

    def __init__(self, args) -> None:
        self.args = args
        self.core = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}   # embed calls
        self._call_ids = itertools.count()

    def start(self, on_step: OnStep, on_dead: OnDead) -> CoreReady:
        """Load the model here, then start the loop thread.

        Raises:
            whatever ``EngineCore(args)`` raises (FileNotFoundError, ValueError, MemoryError).
        """
        self.core = start_engine_core(self.args)
        self._thread = threading.Thread(target=self._run, args=(on_step, on_dead), name="tandem-engine",
                                        daemon=True)
        self._thread.start()
        return ready_message(self.core)

    def _run(self, on_step: OnStep, on_dead: OnDead) -> None:
        reason = "the engine was shut down"

        def emit(msg) -> None:           # the loop's replies to embed calls go to their callers
            if isinstance(msg, CoreReply):
                _resolve_call(self._calls, msg)
            else:
                on_step(msg)

        try:
            run_core_loop(self.core, lambda block: take_all(self._commands, block), emit)
        except BaseException as exc:  # noqa: BLE001 - a bug here must not hang the clients
            logger.exception("the engine loop crashed")
            reason = f"the engine loop crashed: {type(exc).__name__}: {exc}"
        for loop, future in list(self._calls.values()):
            loop.call_soon_threadsafe(_set_exception, future, RuntimeError(reason))
        self._calls.clear()
        on_dead(reason)

    def send(self, cmd: Command) -> None:
        self._commands.put(cmd)

    async def compile_grammar(self, spec) -> str:
        """Validate and compile a ``StructuredOutputsParams`` in the core's
        grammar pool (the core then finds it in its cache); its digest.

        Raises:
            GrammarRefused: the spec is invalid, unsupported, too large (400)
                or its compile timed out (408); the message names the part.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(digest: str, error) -> None:
            if error is None:
                loop.call_soon_threadsafe(_set_result, future, digest)
            else:
                loop.call_soon_threadsafe(_set_exception, future, error)
        # a worker thread: the first call builds the grammar manager (imports xgrammar, seconds)
        await asyncio.to_thread(self.core.submit_grammar, spec, done)
        return await future

    async def embed(self, prompts: list[list[int]], pooling_type: str | None = None,
                    normalize: bool | None = None) -> list[list[float]]:
        """``EngineCore.add_embed`` on the core loop's thread: its vectors once pooled. Raises ValueError as it does."""
        return await _embed_call(self, prompts, pooling_type, normalize)

    async def withdraw(self, request_id: str, by: float, scale: float = 1.0,
                       arrival_tok_s: float = 0.0) -> tuple[bool, float | None]:
        """``EngineCore.withdraw`` on the core loop's thread, between two steps."""
        return await _withdraw_call(self, request_id, by, scale, arrival_tok_s)

    def shutdown(self) -> None:
        self._commands.put(Shutdown())
        if self._thread is not None:
            self._thread.join()

    def is_alive(self) -> bool:
        """The loop runs, and the core can step (no tensor-parallel rank died)."""
        return self._thread is not None and self._thread.is_alive() and self.core.failure is None


class ProcessCoreClient:
    """The core loop in a child process (``engine_core_process: true``, the
    default): multiprocessing "spawn", one duplex pipe, msgpack messages.

    The child gets the torch threads (``num_threads``); the front end needs
    none. The child exits when the pipe closes, so it never outlives this
    process.

    Commands are written to the pipe by a writer thread, in the order sent:
    a large one (a 400 KB schema, in ``CompileGrammar`` and then in its
    ``AddRequest``) fills the pipe and waits for the core's reader thread to
    drain it, 64 KB at a time, each time once it has the core's GIL (which
    the step holds between torch ops): measured up to 130 ms for one
    command on the 2-core box. Written from the event loop, that wait
    stalled every stream's SSE (issue #34); the loop only queues.
    """

    def __init__(self, args) -> None:
        self.args = args
        self._conn = None
        self._proc = None
        self._writer: PipeWriter | None = None
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._closing = False
        self._abandoned = False           # abandon(): the caller stopped waiting for start()
        self._lock = threading.Lock()     # abandon() against start()'s last steps

    @property
    def pid(self) -> int | None:
        """The core process's pid (None before start)."""
        return self._proc.pid if self._proc is not None else None

    def abandon(self) -> None:
        """The caller stops waiting for ``start`` (its server is stopping while the model loads); any thread,
        never blocks. A core still loading is killed by ``start``'s wait, which then raises; one that has loaded
        is asked to stop. Without this, the core (which ignores SIGINT and SIGTERM: the parent drains) outlived
        the abandoned start, and the parent's exit waited for it forever."""
        with self._lock:
            self._abandoned = True
            started = self._writer is not None
        if started:
            self._closing = True
            self.send(Shutdown())
            self._writer.close()

    def start(self, on_step: OnStep, on_dead: OnDead) -> CoreReady:
        """Spawn the core process and wait until it loaded the model.

        Raises:
            FileNotFoundError, ValueError, MemoryError, RuntimeError: the
                core's start-up error, raised again here with its message;
                RuntimeError when the process died without one.
        """
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=run_engine_core_process, args=(self.args, child),
                                 name="tandem-engine-core", daemon=True)
        self._proc.start()
        child.close()
        while not self._conn.poll(0.2):
            if self._abandoned:
                self._stop_loading()
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self._proc.exitcode} "
                                   "while loading the model")
        try:
            first = decode_reply(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._proc.join(5)
            raise RuntimeError(f"the engine core process exited with code {self._proc.exitcode} "
                               "while loading the model") from None
        if isinstance(first, CoreFailed):
            self._proc.join(10)
            raise rebuild_error(first.error_type, first.message)
        with self._lock:
            if self._abandoned:
                self._stop_loading()
            self._writer = PipeWriter(self._conn)
        threading.Thread(target=self._read, args=(on_step, on_dead), name="tandem-core-client",
                         daemon=True).start()
        return first

    def _stop_loading(self) -> None:
        """``start`` after ``abandon``: end the core (killed: nothing of it is in use yet) and raise."""
        self._proc.kill()
        self._proc.join(10)
        self._conn.close()
        raise RuntimeError("the engine's start was abandoned (its server is stopping)")

    def _read(self, on_step: OnStep, on_dead: OnDead) -> None:
        try:
            while True:
                msg = decode_reply(self._conn.recv_bytes())
                if isinstance(msg, CoreReply):
                    self._resolve(msg)
                else:
                    on_step(msg)
        except (EOFError, OSError):
            pass
        except BaseException:  # noqa: BLE001 - a bug here must not hang the clients
            logger.exception("the engine core client failed")
        self._proc.join(2)
        if self._closing:
            reason = "the engine was shut down"
        else:
            reason = f"the engine core process died (exit code {self._proc.exitcode})"
            logger.error("%s; failing the in-flight requests", reason)
        for loop, future in list(self._calls.values()):
            loop.call_soon_threadsafe(_set_exception, future, RuntimeError(reason))
        self._calls.clear()
        if not self._abandoned:   # an abandoned start has no engine to tell
            on_dead(reason)

    def _resolve(self, reply: CoreReply) -> None:
        _resolve_call(self._calls, reply)

    def send(self, cmd: Command) -> None:
        """Encode a command here and queue it for the writer thread (never
        blocks; commands reach the core in the order sent).

        Raises:
            ValueError: the command holds a value the wire cannot carry (an integer beyond 64 bits): the
                request's own fault, answered as its 400, never a failure of the engine.
        """
        try:
            data = encode(cmd)
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:
            raise ValueError(f"the request holds a value the engine cannot take: {exc}") from None
        self._writer.put(data)

    async def compile_grammar(self, spec) -> str:
        """Validate and compile a ``StructuredOutputsParams`` in the core
        process's grammar pool; its digest.

        Raises:
            GrammarRefused: as ``ThreadCoreClient.compile_grammar``.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (loop, future)
        self.send(CompileGrammar(call_id, params_to_wire(spec)))
        return await future

    async def embed(self, prompts: list[list[int]], pooling_type: str | None = None,
                    normalize: bool | None = None) -> list[list[float]]:
        """``EngineCore.add_embed`` in the core process: its vectors once pooled. Raises ValueError as it does."""
        return await _embed_call(self, prompts, pooling_type, normalize)

    async def withdraw(self, request_id: str, by: float, scale: float = 1.0,
                       arrival_tok_s: float = 0.0) -> tuple[bool, float | None]:
        """``EngineCore.withdraw`` in the core process, between two steps."""
        return await _withdraw_call(self, request_id, by, scale, arrival_tok_s)

    def shutdown(self) -> None:
        """Ask the core to stop and wait for its process (killed after 30 s)."""
        self._closing = True
        if self._writer is not None:
            self.send(Shutdown())
            self._writer.close()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()


class PipeWriter:
    """Writes messages to a ``multiprocessing`` connection from a thread of
    its own, in the order put: ``put`` never waits for the reader at the
    other end (see ``ProcessCoreClient``).

    Args:
        conn: the connection (its writing end is this object's from now on).
    """

    def __init__(self, conn) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="tandem-core-writer", daemon=True).start()

    def put(self, data: bytes) -> None:
        """Queue one message (``send_bytes`` framing); returns at once."""
        self._queue.put(data)

    def close(self) -> None:
        """Stop after the messages already put."""
        self._queue.put(None)

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:  # the other end is gone (the core process died: its reader reports it)
                return


async def _embed_call(client, prompts: list[list[int]], pooling_type: str | None,
                      normalize: bool | None) -> list[list[float]]:
    """Send an ``EmbedPrompts`` through ``client`` and wait for its ``CoreReply``. A caller that leaves (the task
    cancelled: its HTTP client disconnected) aborts the call's pooling requests, which free their KV blocks at
    once instead of prefilling to the end for nobody (the core's reply to the aborted call is dropped)."""
    return await _core_call(client, lambda call_id: EmbedPrompts(call_id, prompts, pooling_type or "", normalize),
                            on_cancel=lambda call_id: AbortRequests(embed_request_ids(call_id, len(prompts))))


async def _withdraw_call(client, request_id: str, by: float, scale: float,
                         arrival_tok_s: float) -> tuple[bool, float | None]:
    """Send a ``Withdraw`` through ``client``; (withdrawn, predicted seconds or None) from its ``CoreReply``."""
    withdrawn, seconds = await _core_call(client, lambda call_id: Withdraw(call_id, request_id, by, scale,
                                                                           arrival_tok_s))
    return bool(withdrawn), seconds


async def _core_call(client, command, on_cancel=None):
    """Send ``command(call_id)`` through ``client`` and wait for its ``CoreReply``'s value; when the caller is
    cancelled, send ``on_cancel(call_id)`` (None: nothing) to undo what the command started."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    call_id = next(client._call_ids)
    client._calls[call_id] = (loop, future)
    try:
        client.send(command(call_id))
        return await future
    except asyncio.CancelledError:
        if on_cancel is not None:
            client.send(on_cancel(call_id))
        raise
    finally:
        client._calls.pop(call_id, None)


def _resolve_call(calls: dict, reply: CoreReply) -> None:
    """Complete the call ``reply`` answers: a compile with its grammar's digest, an embed with its vectors; an
    error as the request's own (``GrammarRefused``, a ValueError carrying the reply's HTTP status)."""
    entry = calls.pop(reply.call_id, None)
    if entry is None:
        return
    loop, future = entry
    if reply.error is None:
        loop.call_soon_threadsafe(_set_result, future, reply.digest if reply.digest is not None else reply.value)
    else:
        loop.call_soon_threadsafe(_set_exception, future, GrammarRefused(reply.error, reply.status))


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
