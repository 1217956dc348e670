"""benchmarks/common.stop_process: the servers the memory scripts start are stopped, gracefully when they can be."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
try:
    from common import stop_process
finally:
    sys.path.pop(0)

# Prints "ready" once its SIGTERM handler is set, so the signal cannot arrive before it.
CHILD = "import signal, sys, time; signal.signal(signal.SIGTERM, {}); print('ready', flush=True); time.sleep(60)"


def _start(handler: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(handler)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_graceful_exit_on_sigterm():
    proc = _start("lambda *a: sys.exit(3)")
    stop_process(proc, timeout_s=30)
    assert proc.returncode == 3  # its own handler ran: not killed


def test_killed_when_sigterm_is_ignored():
    proc = _start("signal.SIG_IGN")
    stop_process(proc, timeout_s=0.5)
    assert proc.returncode == -signal.SIGKILL
