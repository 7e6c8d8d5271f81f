"""A process that imports torch and the engine once and forks this host's
tensor-parallel ranks from itself (Android's zygote idea; what
multiprocessing's fork server does, without re-importing the caller's main
module): a rank then starts in milliseconds instead of importing torch
again, seconds on a busy host.

Protocol (``Zygote``): one JSON object a line on the zygote's stdin, the
environment of a rank to start; on its messages pipe (the stdout it was
started with) ``started <pid>`` for each, in order, and ``exited <pid>
<code>`` when one ends (a negative code: killed by that signal). The zygote
is single-threaded when it forks (it polls its children). It exits when its
stdin closes (its parent is gone or done); every rank it forked is killed
then (``PR_SET_PDEATHSIG``), so no rank outlives the engine that started it.
Nothing here runs on import.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading

# what a rank imports (torch's symbolic shapes: its meta tensors' to_empty reads them, 1.4 s of CPU)
PRELOAD = ("torch", "torch.fx.experimental.symbolic_shapes", "engine.executor.worker_main", "engine.model_loader",
           "engine.models.llama", "engine.worker.model_runner", "engine.distributed.parallel_state",
           "engine.model_loader.hf", "engine.model_loader.gguf_loader", "safetensors", "kernels.cpu_attention",
           "kernels.cpu_linear", "kernels.cpu_norm_act", "kernels.torch_attention")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent (the zygote) ends (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _fork_rank(env: dict[str, str], messages) -> int:
    """Fork one rank; in the child, serve (``worker_main.serve``) and never return."""
    pid = os.fork()
    if pid:
        return pid
    try:
        messages.close()
        _die_with_parent()
        os.environ.update(env)
        from engine.executor.worker_main import serve

        serve()
    finally:
        os._exit(1)


def main() -> None:
    """The zygote's loop: start ranks as asked, report them, exit when stdin closes."""
    import importlib

    messages = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # a rank's prints go to stderr, not into the messages
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C reaches the process group: the engine decides
    for name in PRELOAD:
        importlib.import_module(name)
    children: set[int] = set()
    pending = b""
    while True:
        if select.select([0], [], [], 0.1)[0]:
            data = os.read(0, 65536)
            if not data:
                os._exit(0)   # the ranks die with us (PR_SET_PDEATHSIG)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = _fork_rank(json.loads(line), messages)
                children.add(pid)
                messages.write(f"started {pid}\n")
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                messages.write(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n")


class Zygote:
    """The driver's side: a zygote process started now (``python -m engine.executor.zygote``) and a reader
    thread that records its ranks' exit codes.

    Attributes:
        exit_codes: pid -> exit code of each rank that ended.
    """

    def __init__(self) -> None:
        env = dict(os.environ)
        if env.get("TANDEM_CPUS"):   # this process's OpenMP places (choose_omp_binding), read by the zygote's
            for key in ("OMP_PROC_BIND", "OMP_PLACES", "TANDEM_CPUS"):   # OpenMP at its import: each rank pins
                env.pop(key, None)                                       # its threads by affinity instead
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.executor.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.exit_codes: dict[int, int] = {}
        self._started: list[int] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, name="tandem-zygote-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, pid, *code = line.split()
            with self._cond:
                if kind == "started":
                    self._started.append(int(pid))
                else:
                    self.exit_codes[int(pid)] = int(code[0])
                self._cond.notify_all()
        with self._cond:   # the zygote is gone, and with it every rank it forked
            self._started.append(-1)
            self._cond.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, env: dict[str, str], timeout_s: float = 600.0) -> int:
        """Start a rank with ``env`` (added to the zygote's environment); its pid.

        Raises:
            RuntimeError: the zygote died, or did not answer within ``timeout_s`` (it imports torch first).
        """
        with self._cond:
            self.proc.stdin.write(json.dumps(env) + "\n")
            self.proc.stdin.flush()
            if not self._cond.wait_for(lambda: self._started, timeout_s) or self._started[0] == -1:
                raise RuntimeError(f"the tensor-parallel zygote did not start a rank (exit code {self.proc.poll()})")
            return self._started.pop(0)

    def close(self) -> None:
        """End the zygote (and every rank it forked)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait()


if __name__ == "__main__":
    main()
