"""The disk tier of the prefix cache (--kv-offload-dir): full blocks' K/V in files named by block hash.

    pool hit? --no--> file DIR/ab/abcd...kv? --yes--> read, check, load into a new block (no recompute)
                                            --no---> recompute; once full and cached, the block is written

Block hashes chain from a root made of the model's identity (a digest of its weight files' contents, not
their paths), its dtype, the KV dtype, the block size and the backend, never from Python's per-process
hash: so a restarted engine, or another replica on the same volume, finds the same files. cache_salt is in
the first block's key (block_pool.salt_key), so salted prefixes stay private on disk as in memory.

Files are written by one thread per engine, on CPU time nothing else wants (SCHED_IDLE), or by a thread
waiting for them in flush: into a temporary name beside the final one, then renamed, so a reader sees a whole
file or none, and replicas writing the same block at once write the same bytes. A file
carries its hash, length and CRC-32; one that does not check out (torn, truncated, bit rot) counts as a
miss, is removed and recomputed. Over --kv-offload-max-bytes the least recently used files (by mtime; a read
touches its file) go until 90% of the bound is left.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, replace

from pagedserve.core.block_pool import BlockHash
from pagedserve.core.kv_events import TierEvents

MAGIC = b"PSKV"
VERSION = 1
_HEADER = struct.Struct("<4sI32sQI")  # magic, version, block hash, payload bytes, CRC-32 of the payload
SUFFIX = ".kv"
STALE_TMP_S = 3600.0           # a temporary file this old belongs to a writer that died
MAX_QUEUED_BYTES = 256 << 20   # blocks waiting for the writer beyond this are dropped (counted), not queued
WRITER_NICENESS = 19
EXIT_FLUSH_S = 30.0            # at interpreter exit, queued blocks get this long to reach the disk
FULL_HASH_BYTES = 512 << 20    # model files up to this size are hashed whole for their identity
SAMPLE_BYTES = 64 << 10


@dataclass(slots=True)
class KVOffloadStats:
    num_stored_blocks: int = 0
    num_loaded_blocks: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    num_hit_tokens: int = 0        # prompt tokens loaded from disk instead of computed
    num_evicted_blocks: int = 0
    num_corrupt_blocks: int = 0
    num_dropped_stores: int = 0    # the writer fell behind: MAX_QUEUED_BYTES queued, or the pin bound
    disk_bytes: int = 0            # bytes of block files in the directory at the last scan or write
    writer_cpu_seconds: float = 0.0  # the writer thread's CPU time (checks, writes, evictions)


@dataclass(frozen=True, slots=True)
class DiskRecord:
    # A block to write: where its K/V is now, its key, and what its KV event reports (tokens, parent, salt).
    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...] | None


def check_offload_config(config) -> None:
    """ValueError for an EngineConfig the disk tier cannot serve (checked before the model loads)."""
    cache = config.cache
    if cache.kv_offload_dir is None:
        return
    if not cache.enable_prefix_caching:
        raise ValueError("--kv-offload-dir needs prefix caching: drop --no-enable-prefix-caching")
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("--kv-offload-dir does not support --tensor-parallel-size > 1 yet")


def model_fingerprint(path: str, load_format: str = "auto") -> str:
    # The model's identity from its files' contents, so copies of one model on two machines agree and a
    # replaced file does not. Files up to FULL_HASH_BYTES are hashed whole; larger ones by name, size and 64
    # evenly spaced 64 KiB samples (hashing many GB at every start would cost seconds).
    h = hashlib.sha256(f"load_format={load_format}".encode())
    if os.path.isdir(path):
        names = ["config.json"]
        if load_format != "dummy":  # dummy weights come from the config and a fixed seed
            names += sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".gguf", ".bin")))
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    for file in files:
        size = os.path.getsize(file)
        h.update(f"{os.path.basename(file)}:{size}".encode())
        with open(file, "rb") as f:
            if size <= FULL_HASH_BYTES:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                continue
            for i in range(64):
                f.seek((size - SAMPLE_BYTES) * i // 63)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def make_disk_hash_root(fingerprint: str, **layout: object) -> BlockHash:
    # layout: dtype, KV dtype, block size, ... : anything that changes the bytes of a block.
    key = json.dumps({"fingerprint": fingerprint, **layout}, sort_keys=True)
    return hashlib.sha256(b"pagedserve-kv-disk-v1:" + key.encode()).digest()


class DiskKVStore:
    def __init__(self, directory: str, max_bytes: int | None, block_nbytes: int, hash_root: BlockHash) -> None:
        if max_bytes is not None and max_bytes < block_nbytes + _HEADER.size:
            raise ValueError(f"--kv-offload-max-bytes {max_bytes} cannot hold one block "
                             f"({block_nbytes + _HEADER.size} bytes)")
        self.directory = os.path.abspath(os.path.expanduser(directory))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--kv-offload-dir {self.directory}: cannot create it ({e.strerror})") from e
        if not os.access(self.directory, os.R_OK | os.W_OK | os.X_OK):
            raise ValueError(f"--kv-offload-dir {self.directory}: not readable and writable by this process")
        self.max_bytes = max_bytes
        self.block_nbytes = block_nbytes
        self.hash_root = hash_root
        self.stats = KVOffloadStats()
        self.events: TierEvents | None = None  # medium "DISK", set by the KV manager when KV events are on
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the queue has been written out
        self._evicting = threading.Lock()  # one eviction scan at a time (the writer thread and flush write at once)
        self._tmp_seq = 0
        self._written: list[int] = []  # pinned blocks written (or failed), for take_written
        self._pinned_queued: dict[int, list] = {}  # block id -> its queue item, until the writer starts it
        self._scan()  # the directory's size, before the first write can push it over the bound
        self._thread = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._thread.start()
        # An offline LLM has no shutdown: the writer is a daemon thread, so without this the last blocks
        # queued before the interpreter exits would be lost.
        atexit.register(_flush_at_exit, weakref.ref(self))

    def path(self, block_hash: BlockHash) -> str:
        name = block_hash.hex()
        return os.path.join(self.directory, name[:2], name + SUFFIX)

    # ------------------------------------------------------------------ reads (engine thread)

    def load(self, block_hash: BlockHash) -> bytearray | None:
        """The block's K/V bytes, or None when no intact file holds them."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                payload = bytearray(self.block_nbytes)
                n = f.readinto(payload)
                extra = f.read(1)
        except FileNotFoundError:
            return None
        except OSError:
            self.stats.num_corrupt_blocks += 1
            return None
        if len(header) != _HEADER.size or n != self.block_nbytes or extra:
            return self._corrupt(path)
        magic, version, stored_hash, length, crc = _HEADER.unpack(header)
        if (magic != MAGIC or version != VERSION or stored_hash != block_hash or length != self.block_nbytes
                or zlib.crc32(payload) != crc):
            return self._corrupt(path)
        try:
            os.utime(path)  # recently used: the LRU bound evicts it last
        except OSError:
            pass
        return payload

    def _corrupt(self, path: str) -> None:
        self.stats.num_corrupt_blocks += 1
        self._remove(path)  # recomputed and written again
        return None

    def _remove(self, path: str) -> bool:
        if not _unlink(path):
            return False
        if self.events is not None:
            self.events.removed([bytes.fromhex(os.path.basename(path).removesuffix(SUFFIX))])
        return True

    # ------------------------------------------------------------------ writes (writer thread)

    def room(self) -> int:
        # How many more blocks may be queued now: the caller drops the rest before copying or pinning them
        # (and counts them in num_dropped_stores), so a dropped block costs nothing.
        with self._lock:
            return max(0, (MAX_QUEUED_BYTES - self._queued_bytes) // self.block_nbytes)

    def store(self, record: DiskRecord, payload, pinned: bool = False) -> None:
        """Queue a full block's K/V: a bytes-like object of block_nbytes, or a list of them in file order,
        not changed until written. pinned: they are views of the pool, and the block stays pinned (not
        allocatable) until take_written() returns its id, written or not."""
        with self._lock:
            if self._queued_bytes + self.block_nbytes > MAX_QUEUED_BYTES:
                self.stats.num_dropped_stores += 1
                if pinned:
                    self._written.append(record.block_id)
                return
            self._queued_bytes += self.block_nbytes
        item = [record, payload if isinstance(payload, list) else [payload], pinned, False]  # False: not cancelled
        if pinned:
            with self._lock:
                self._pinned_queued[record.block_id] = item
        self._queue.put(item)

    def take_written(self) -> list[int]:
        # Block ids of pinned stores the writer is done with (engine thread: it unpins them).
        with self._lock:
            done, self._written = self._written, []
        return done

    def cancel_pinned(self) -> list[int]:
        # The pool is short: pinned stores the writer has not started are dropped (counted); their block ids,
        # to unpin now. A block being written stays pinned until take_written returns it.
        with self._lock:
            items, self._pinned_queued = list(self._pinned_queued.values()), {}
            for item in items:
                item[3] = True
            self._queued_bytes -= len(items) * self.block_nbytes
            self.stats.num_dropped_stores += len(items)
            if not self._queued_bytes:
                self._idle.notify_all()
        return [item[0].block_id for item in items]

    def flush(self, timeout: float | None = None) -> bool:
        # True once every queued block is on disk (tests, benchmarks, shutdown); False if timeout ran out.
        # The caller writes what the writer has not started: it is waiting anyway, at its own priority.
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # close() is under way: the writer thread stops at it
                self._queue.put(None)
                break
            self._run(item)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with self._idle:
            return self._idle.wait_for(lambda: self._queued_bytes == 0, left)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _write_loop(self) -> None:
        _run_when_idle()
        while (item := self._queue.get()) is not None:
            self._run(item)

    def _run(self, item: list) -> None:
        # One queued block: written by the writer thread, or by a thread waiting in flush, which takes the
        # queue's items itself (the writer at idle priority may get no CPU for long on a busy machine); the
        # two may write different blocks at once (temporary names carry the thread id).
        record, chunks, pinned, _ = item
        with self._lock:
            if item[3]:  # cancelled: its pin is gone and its bytes no longer counted
                return
            if pinned:
                del self._pinned_queued[record.block_id]
        t0 = time.thread_time()
        try:
            self._write(record, chunks)
        except OSError:  # a full or read-only volume: the block stays recomputable, serving goes on
            pass
        finally:
            with self._lock:
                self.stats.writer_cpu_seconds += time.thread_time() - t0
                self._queued_bytes -= self.block_nbytes
                if pinned:
                    self._written.append(record.block_id)
                if not self._queued_bytes:
                    self._idle.notify_all()

    def _write(self, record: DiskRecord, chunks: list) -> None:
        block_hash = record.block_hash
        path = self.path(block_hash)
        if os.path.exists(path):  # another replica, or an earlier run, wrote it
            os.utime(path)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._tmp_seq += 1
        tmp = f"{path}.{os.getpid()}.{threading.get_native_id()}.{self._tmp_seq}.tmp"
        crc = 0
        for chunk in chunks:  # zlib and writev release the GIL: the engine thread runs meanwhile
            crc = zlib.crc32(chunk, crc)
        header = _HEADER.pack(MAGIC, VERSION, block_hash, self.block_nbytes, crc)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:  # straight from the pool's memory (pinned blocks) into the file: no copy on the way
                if os.writev(fd, [header, *chunks]) != _HEADER.size + self.block_nbytes:
                    raise OSError("short write")
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        with self._lock:
            self.stats.num_stored_blocks += 1
            self.stats.stored_bytes += self.block_nbytes
            self.stats.disk_bytes += _HEADER.size + self.block_nbytes
            over = self.max_bytes is not None and self.stats.disk_bytes > self.max_bytes
        if self.events is not None:
            self.events.stored([block_hash], record.parent_hash, record.token_ids, [record.extra_keys])
        if over and self._evicting.acquire(blocking=False):  # else the other writer is evicting already
            try:
                self._evict()
            finally:
                self._evicting.release()

    def _scan(self) -> list[tuple[float, int, str]]:
        # Every block file as (mtime, size, path); removes dead writers' temporary files on the way.
        files = []
        now = time.time()
        for sub in os.scandir(self.directory):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat()
                except OSError:
                    continue  # removed by another replica meanwhile
                if entry.name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, entry.path))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    _unlink(entry.path)
        self.stats.disk_bytes = sum(size for _, size, _ in files)
        return files

    def _evict(self) -> None:
        # The directory may be shared: its real size comes from a scan, not from this writer's count.
        files = sorted(self._scan())
        total = self.stats.disk_bytes
        target = int(self.max_bytes * 0.9)
        for _, size, path in files:
            if total <= target:
                break
            if self._remove(path):
                self.stats.num_evicted_blocks += 1
            total -= size
        self.stats.disk_bytes = total

    def snapshot(self) -> KVOffloadStats:
        return replace(self.stats)


def _run_when_idle() -> None:
    # The writer thread takes only CPU time nothing else wants (SCHED_IDLE). At niceness 19 it still had
    # its share of a busy core (about 1.4%, 0.3 s in a 10 s no-reuse round on 2 cores), and every slice it
    # took from an OpenMP thread stalled the whole step's parallel region; a SCHED_IDLE thread gets about a
    # fifth of that and is preempted as soon as a normal thread wakes. Where that is refused: niceness 19.
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
        pass


def _flush_at_exit(ref: weakref.ref) -> None:
    store = ref()
    if store is not None:
        store.flush(EXIT_FLUSH_S)


def _unlink(path: str) -> bool:
    # False when it was not there (another replica removed it) or cannot be removed.
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
