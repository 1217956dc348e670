"""The kernel cache's defences: a library is loaded only when its bytes are those of its build, a dead
builder's lock does not hang the next start, and a build that cannot happen leaves the torch paths."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pagedserve import kernels


def _replace(path: str, data: bytes) -> None:
    # A new file under the old name: the loaded library's pages stay mapped from the old one (rewriting a
    # dlopen-ed file in place crashes this process at exit, when the loader runs the library's finalizers).
    os.remove(path)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture
def tiny_library(tmp_path) -> str:
    # A real shared library (nothing in it): what torch.ops.load_library dlopens.
    src = tmp_path / "empty.c"
    src.write_text("int pagedserve_test_symbol(void) { return 1; }\n")
    library = str(tmp_path / "lib.so")
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", library, str(src)], check=True)
    return library


def test_only_a_library_that_hashes_as_built_is_loaded(tiny_library, caplog):
    kernels._record_hash(tiny_library)
    assert kernels._load_built(tiny_library)
    data = open(tiny_library, "rb").read()
    for changed in (data[:len(data) // 2], data[:-1] + bytes([data[-1] ^ 1])):  # truncated, overwritten
        _replace(tiny_library, changed)
        with caplog.at_level(logging.WARNING, logger="pagedserve.kernels"):
            assert not kernels._load_built(tiny_library)  # refused before dlopen could crash the process
        assert f"{tiny_library} differs from the library that was built there" in caplog.text


def test_a_build_without_a_recorded_hash_is_checked_in_a_child(tiny_library):
    assert kernels._load_built(tiny_library)
    assert open(f"{tiny_library}.sha256").read() == kernels._library_hash(tiny_library)
    os.remove(f"{tiny_library}.sha256")
    data = open(tiny_library, "rb").read()
    _replace(tiny_library, data[:len(data) // 3])
    assert not kernels._load_built(tiny_library)  # the child failed (or crashed), this process goes on
    assert not os.path.exists(f"{tiny_library}.sha256")


_HOLD_LOCK = """
import fcntl, os, sys, time
build_dir = sys.argv[1]
f = open(os.path.join(build_dir, "pagedserve.lock"), "a")
fcntl.flock(f, fcntl.LOCK_EX)
open(os.path.join(build_dir, "lock"), "w").close()  # cpp_extension's lock file, as a build leaves it
print("held", flush=True)
time.sleep(600)
"""


def test_a_dead_builders_lock_is_released(tmp_path):
    build_dir = str(tmp_path / "build")
    os.makedirs(build_dir)
    builder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, build_dir], stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "held"
    entered = threading.Event()

    def start():
        with kernels._build_dir_lock(build_dir):
            entered.set()
            assert not os.path.exists(os.path.join(build_dir, "lock"))  # the leftover went

    waiter = threading.Thread(target=start)
    waiter.start()
    time.sleep(0.5)
    assert not entered.is_set()  # a live builder is waited for
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    waiter.join(30)
    assert entered.is_set()


def test_a_build_that_fails_leaves_the_torch_paths(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    builds = []

    def no_space(**kwargs):
        builds.append(kwargs["name"])
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDSERVE_REQUIRE_KERNELS", raising=False)  # CI sets it (.ci/run)
    monkeypatch.setattr(cpp_extension, "load", no_space)
    monkeypatch.setattr(kernels, "_variant_ops", {})
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels"):
        assert kernels._load_uncached() == (None, None)
    assert "No space left on device" in caplog.text and "using the pure-torch paths" in caplog.text
    assert len(builds) == 1  # the other variants' builds would fail the same way, each after minutes
    # Where kernels are required (CI), the same failure is an error, and prebuild (scripts/setup) raises too.
    monkeypatch.setenv("PAGEDSERVE_REQUIRE_KERNELS", "1")
    with pytest.raises(RuntimeError, match="PAGEDSERVE_REQUIRE_KERNELS=1"):
        kernels._load_uncached()
    monkeypatch.setattr(kernels, "parity_isas", lambda: ["baseline"])
    with pytest.raises(OSError, match="No space left"):
        kernels.prebuild()
    monkeypatch.delenv("PAGEDSERVE_REQUIRE_KERNELS")
    assert kernels.prebuild() == []
