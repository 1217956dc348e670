"""Grammar compiles in processes: xgrammar cannot cancel a compile, but a process can be killed.

    server (grammar service)                      zygote (one, started with the one-time tables)
    CompileZygote(tokenizer_info_json) --spawn--> TokenizerInfo from the JSON, then waits
    new_process() --socket end------------------> fork: a compile process with the tables (copy-on-write)
    CompileProcess.compile(kind, text, timeout)   compile process (one per grammar thread)
                 ---(kind, text)----------------> GrammarCompiler.compile_...
                 <--("ok", json)----------------  CompiledGrammar.serialize_json()
    CompiledGrammar.deserialize_json(json, info)
    no answer within the timeout: SIGKILL it; the thread's next compile forks a new one (milliseconds)

The zygote imports xgrammar's compiler without torch or transformers (import_compiler) and builds the tokenizer
tables once; its compile processes share those pages, so each costs only what its compiles allocate. The zygote
exits when the server's end of its socket closes (with the server), the compile processes with the zygote
(PR_SET_PDEATHSIG) or when the server's end of theirs closes.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import types
from multiprocessing.connection import Connection
from typing import Any


class CompileTimeout(Exception):
    """The compile passed its timeout, or a waiter stopped it: its process is killed."""


class CompileProcessGone(Exception):
    """The process had exited before it was sent the compile (with its zygote): the compile never started."""


class CompileProcess:
    def __init__(self, pid: int, conn: Connection) -> None:
        self.pid = pid
        self.conn = conn
        self.stopped = False

    def compile(self, kind: str, text: str, timeout_s: float) -> str:
        """The compiled grammar as xgrammar's JSON; RuntimeError with xgrammar's message for a grammar it
        refuses; CompileTimeout past timeout_s or after stop(); ValueError when the process died otherwise."""
        try:
            self.conn.send((kind, text))
        except OSError:
            self.conn.close()
            raise CompileProcessGone("the grammar compile process exited") from None
        try:
            if not self.conn.poll(timeout_s):
                self.stop()
            else:
                status, payload = self.conn.recv()
                if status == "ok":
                    return payload
                raise RuntimeError(payload)
        except (EOFError, OSError):
            pass  # it exited: killed by stop(), or died
        self.conn.close()
        if self.stopped:
            raise CompileTimeout()
        raise ValueError("the grammar compile process exited")

    def stop(self) -> None:
        # Any thread: ends a running compile (compile raises CompileTimeout), or the idle process.
        self.stopped = True
        try:
            os.kill(self.pid, signal.SIGKILL)  # the zygote reaps it
        except ProcessLookupError:
            pass


class CompileZygote:
    """The zygote's server end. If the zygote dies (killed by hand, OOM), the next new_process starts another
    from the same tables, so one lost process does not fail every later structured request."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._tables = tokenizer_info_json.encode()
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from pagedserve.structured_output.compile_worker import zygote; zygote()",
             str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        ours.sendall(struct.pack("q", len(self._tables)) + self._tables)
        if _recv_exactly(ours, 1) != b"r":  # ready: the tables are built
            raise RuntimeError("the grammar compile zygote failed to start")

    def new_process(self) -> CompileProcess:
        with self._lock:
            try:
                return self._fork()
            except (EOFError, OSError):  # the zygote died: start another (seconds) and fork from it
                self.proc.kill()
                self.proc.wait()
                self._sock.close()
                self._start()
                return self._fork()

    def _fork(self) -> CompileProcess:
        ours, theirs = socket.socketpair()
        try:
            socket.send_fds(self._sock, [b"f"], [theirs.fileno()])
            (pid,) = struct.unpack("q", _recv_exactly(self._sock, 8))
        except (EOFError, OSError):
            ours.close()
            raise
        finally:
            theirs.close()
        return CompileProcess(pid, Connection(ours.detach()))

    def close(self) -> None:
        with self._lock:
            self.proc.kill()
            self.proc.wait()
            self._sock.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the grammar compile zygote exited")
        data += chunk
    return data


def import_compiler() -> Any:
    """xgrammar's compiler and tokenizer info without torch or transformers (for the zygote only).

    The package's __init__ imports its matcher, which imports torch; tvm_ffi imports torch if it can; the
    tokenizer info module imports transformers for two class names that only from_huggingface uses. Without
    them the zygote holds ~28 MB of its own memory before the tables, against ~230 MB with torch.
    """
    sys.modules["torch"] = None  # type: ignore[assignment]  (import torch: ImportError, which tvm_ffi expects)
    stub = types.ModuleType("transformers")
    stub.PreTrainedTokenizerBase = stub.PreTrainedTokenizerFast = type("NotUsed", (), {})
    sys.modules["transformers"] = stub
    spec = importlib.util.find_spec("xgrammar")
    package = types.ModuleType("xgrammar")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["xgrammar"] = package
    import xgrammar.load_binding  # noqa: F401 (the native library: registers the types the bindings name)
    from xgrammar.compiler import GrammarCompiler
    from xgrammar.tokenizer_info import TokenizerInfo

    package.GrammarCompiler, package.TokenizerInfo = GrammarCompiler, TokenizerInfo
    return package


def compile_spec(compiler: Any, kind: str, text: str) -> Any:
    """xgrammar's compile of a GrammarSpec's kind and text (structured_output/backend.py); RuntimeError from
    xgrammar for a grammar it refuses."""
    if kind == "json":
        # Compact separators, no free whitespace: a small model left free whitespace can pad forever.
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        # Any object (OpenAI's json_object), not any JSON value; properties are free.
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def zygote() -> None:
    # No PR_SET_PDEATHSIG here: it follows the thread that started the process, which may end first. The
    # server's end of the socket closes with the server, and then this loop ends.
    sock = socket.socket(fileno=int(sys.argv[1]))
    os.nice(19)  # compiles run on the cycles the engine leaves, like the grammar threads
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # compile processes are reaped by the kernel
    try:
        (size,) = struct.unpack("q", _recv_exactly(sock, 8))
        xgr = import_compiler()
        info = xgr.TokenizerInfo.deserialize_json(_recv_exactly(sock, size).decode())
        sock.sendall(b"r")
        while True:
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            if not fds:
                return  # the server closed its end
            pid = os.fork()
            if pid == 0:
                sock.close()
                _compile_process(xgr, info, fds[0])
                os._exit(0)
            os.close(fds[0])
            sock.sendall(struct.pack("q", pid))
    except (EOFError, OSError, KeyboardInterrupt):
        pass


def _compile_process(xgr: Any, info: Any, fd: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    conn = Connection(fd)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        while True:
            kind, text = conn.recv()
            try:
                conn.send(("ok", compile_spec(compiler, kind, text).serialize_json()))
            except RuntimeError as exc:
                conn.send(("error", str(exc)))
    except (EOFError, OSError, KeyboardInterrupt):
        pass
