"""Pageable host memory through pinned staging chunks.

CUDA copies pageable host memory through the driver's own small staging buffer, on the
calling thread: a 1 GiB upload ran at 9.3 GB/s on an H200, against 55 GB/s from pinned
memory. A `Stager` (one per device and environment, made on first use) moves
pageable sources and destinations through a bounded set of pinned *chunks* taken from the
device's pinned pool, with ``threads`` worker threads:

* **upload** piece (at most one chunk of a pair): the workers copy the pageable bytes into
  a free chunk (split into slices, numpy copies release the GIL), then ``cuMemcpyAsync``
  from the chunk on the stager's upload stream. The chunk is free again once an event
  recorded after that copy has completed: the factory's dispatcher calls back (a host
  function or polling, as for every notification); no thread waits for it.
* **download** piece: ``cuMemcpyAsync`` into a free chunk on the download stream; once it
  has completed (dispatcher again) the workers copy the chunk into the destination, and
  the chunk is free.
* **host** piece (pageable <-> pinned memory): the workers copy it directly.

While one chunk is being filled or drained on the host, the others are on the device:
host copies and device copies overlap. The pieces of one batch run in any order (they
never overlap: the core validated the batch); batches are served in submission order.
A batch is done when its last upload is enqueued and its last download has landed in
host memory: its ``on_done`` runs then, on a worker (the transfer opens the caller's
stream gate there, see `._transfer`), and its host memory is let go; it is
*released* once the device work enqueued up to then has completed. Staging memory is
bounded: at most ``chunks`` chunks of ``chunk_bytes`` per device (rounded up to the pinned
pool's size class), whatever the number of copies in flight (more copies queue for
chunks, in submission order).

``chunks=0`` turns staging off: each pair is one ``cuMemcpyAsync`` of the pageable memory
issued by a worker (the driver's own staging, synchronous for the worker): the baseline.

Nothing here blocks the event loop: `Stager.submit` appends to a queue.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from aioep import ClosedError, DeviceError

from ._driver import call_nogil, check, ctx_current, driver
from ._pool import Block, size_class
from ._stream import CudaStream
from ._wake import _report

if TYPE_CHECKING:
    from ._device import CudaDevice
    from ._wake import Dispatcher

__all__ = [
    "D2H",
    "DEFAULT_CHUNKS",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_THREADS",
    "H2D",
    "HOST",
    "Staging",
    "StagedJob",
    "Stager",
    "StagingOptions",
    "host_copy",
]

H2D, D2H, HOST = 0, 1, 2
"""Piece kinds: pageable -> device, device -> pageable, pageable <-> pinned host memory."""

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_CHUNKS = 4
DEFAULT_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Defaults from one measurement on an H200 host (8 threads, 64 MiB chunks, 4 in flight:
26.5 GB/s up, 27.8 GB/s down); provisional until ``benchmarks/cuda_pageable.py`` has
measured this implementation on a GPU."""

MIN_SLICE_BYTES = 1 << 20
"""A piece is split among the workers in slices of at least this size."""

CLOSE_TIMEOUT = 60.0
"""Seconds `Stager.close` waits for batches in flight before it abandons them."""


@dataclass(frozen=True)
class StagingOptions:
    """How pageable host memory is staged (see the module docstring)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    chunks: int = DEFAULT_CHUNKS
    threads: int = DEFAULT_THREADS

    @property
    def bound(self) -> int:
        """Most bytes of pinned staging memory one device's stager holds: ``chunks`` blocks
        of the pinned pool's size for ``chunk_bytes`` (a power of two up to 1 MiB, then a
        multiple of 1 MiB: 64 MiB chunks take exactly 64 MiB)."""
        return size_class(self.chunk_bytes) * self.chunks


def host_copy(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> None:
    """The host side of one slice (numpy releases the GIL for it). Workers look it up at
    each call, so a test may replace it (a slow host thread)."""
    np.copyto(dst, src)


def _bytes_at(addr: int, n: int) -> npt.NDArray[np.uint8]:
    """A uint8 view of ``n`` bytes of host memory at ``addr`` (the caller keeps it alive)."""
    if n <= 0:
        return np.empty(0, np.uint8)
    view: npt.NDArray[np.uint8] = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(addr))
    return view


class _Chunk:
    """One pinned staging chunk: a block of the device's pinned pool and a byte view of it."""

    __slots__ = ("block", "view")

    def __init__(self, block: Block) -> None:
        self.block = block
        self.view = _bytes_at(block.ptr, block.size)


class _Piece:
    """At most one chunk of one pair. ``dst``/``src``: addresses; ``to``/``frm``: the host
    views the slices copy between (set when the piece starts)."""

    __slots__ = ("chunk", "dst", "frm", "job", "kind", "left", "n", "src", "to")

    def __init__(self, job: StagedJob, kind: int, dst: int, src: int, n: int) -> None:
        self.job, self.kind, self.dst, self.src, self.n = job, kind, dst, src, n
        self.chunk: _Chunk | None = None
        self.left = 0
        self.to: npt.NDArray[np.uint8] | None = None
        self.frm: npt.NDArray[np.uint8] | None = None


OnDone = Callable[["StagedJob", "CudaStream | None"], None]


class StagedJob:
    """One submitted batch of pageable pairs ``(kind, dst, src, nbytes)``.

    ``on_done(job, stream)`` runs on a worker once every upload is enqueued on ``stream``
    and every download has landed (``job.error`` says whether it all went well); work
    the caller enqueues on ``stream`` there is ordered after the uploads (``stream`` is
    None if the staging streams could not be made: then nothing reached the device). ``keep`` (the
    host memory the workers read or write) is let go right after; `released` is
    set once the device work has completed too.
    """

    __slots__ = (
        "_cursor",
        "_pairs",
        "_step",
        "back",
        "error",
        "h2d",
        "keep",
        "left",
        "on_done",
        "released",
    )

    def __init__(
        self,
        pairs: Sequence[tuple[int, int, int, int]],
        keep: Sequence[Any],
        on_done: OnDone | None,
        step: int | None,
    ) -> None:
        self._pairs = [p for p in pairs if p[3] > 0]
        self._step = step
        self._cursor = (0, 0)  # (pair index, offset) of the next piece to start
        self.back: collections.deque[_Piece] = collections.deque()  # pieces put back
        self.keep: Sequence[Any] = keep
        self.on_done: OnDone | None = on_done
        self.error: BaseException | None = None
        self.released = threading.Event()
        self.h2d = any(p[0] == H2D for p in self._pairs)
        self.left = sum(self._count(p) for p in self._pairs)
        """Pieces not finished yet (then: the two steps of its release, see ``_finish``)."""

    def _size(self, pair: tuple[int, int, int, int]) -> int:
        kind, n = pair[0], pair[3]
        if self._step is None and kind != HOST:
            return n  # unstaged: one driver copy per pair
        return self._step or n

    def _count(self, pair: tuple[int, int, int, int]) -> int:
        return -(-pair[3] // self._size(pair))

    def fail(self, exc: BaseException) -> None:
        """Record the batch's first failure."""
        if self.error is None:
            self.error = exc

    def peek_kind(self) -> int | None:
        """The kind of the next piece to start, or None when every piece has started."""
        if self.back:
            return self.back[0].kind
        i = self._cursor[0]
        return self._pairs[i][0] if i < len(self._pairs) else None

    def pop(self) -> _Piece:
        """The next piece to start (call only after `peek_kind` gave a kind)."""
        if self.back:
            return self.back.popleft()
        i, off = self._cursor
        kind, dst, src, n = self._pairs[i]
        m = min(self._size(self._pairs[i]), n - off)
        self._cursor = (i, off + m) if off + m < n else (i + 1, 0)
        return _Piece(self, kind, dst + off, src + off, m)


class Stager:
    """Stages one device's pageable copies (see the module docstring).

    Args:
        device: the GPU (its pinned pool provides the chunks).
        dispatcher: the factory's dispatcher (completion callbacks of the staging streams).
        options: chunk size, chunk count (0: unstaged), worker threads.
        wake: the staging streams' wake mode; ``owner``: their owner (the factory).
    """

    def __init__(
        self,
        device: CudaDevice,
        dispatcher: Dispatcher,
        options: StagingOptions,
        *,
        wake: str = "hostfn",
        owner: Any = None,
    ) -> None:
        self.device = device
        self.options = options
        self._dispatcher = dispatcher
        self._wake = wake
        self._owner = owner
        self._staged = options.chunks > 0
        self._cond = threading.Condition()
        self._jobs: collections.deque[StagedJob] = collections.deque()
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()
        self._free: list[_Chunk] = []
        self._chunks: list[_Chunk] = []
        self._allocating = 0
        self._cap = options.chunks
        self._workers: list[threading.Thread] = []
        self._active = 0  # jobs submitted and not released
        self._closed = False
        self._stop = False
        self._streams: tuple[CudaStream, CudaStream] | None = None
        self._streams_lock = threading.Lock()
        self.peak_bytes = 0
        """Most pinned staging memory held at once so far (bytes)."""
        self.jobs = 0
        """Batches submitted so far."""
        self.pieces = 0
        """Pieces (chunk-sized copies) started so far."""

    # -- public ------------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Pinned staging memory held now (bytes)."""
        with self._cond:
            return sum(c.block.size for c in self._chunks)

    def submit(
        self,
        pairs: Sequence[tuple[int, int, int, int]],
        keep: Sequence[Any],
        on_done: OnDone | None = None,
    ) -> StagedJob | None:
        """Queue a batch of ``(kind, dst, src, nbytes)`` pairs whose prerequisites are done;
        ``keep``: the host memory's owners, kept alive until the workers are done with it
        (the device memory must be kept alive by the caller until the batch's device
        work has completed). Never blocks. None if the stager is closed (nothing was
        queued)."""
        step = self.options.chunk_bytes if self._staged else None
        job = StagedJob(pairs, keep, on_done, step)
        with self._cond:
            if self._closed:
                return None
            self._active += 1
            self.jobs += 1
            self._jobs.append(job)
            self._start_workers()
            self._cond.notify_all()
        return job

    def close(self) -> None:
        """Let the queued batches finish (bounded by `CLOSE_TIMEOUT`), stop the workers,
        give the chunks back to the pinned pool (reused only after the staging streams'
        work) and destroy the staging streams. Off the event loop (it waits); idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            workers = list(self._workers)
        deadline = time.monotonic() + CLOSE_TIMEOUT
        for w in workers:
            if w is not threading.current_thread():
                w.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._stop = True
            abandoned = list(self._jobs)
            self._jobs.clear()
            self._tasks.clear()
            self._cond.notify_all()
        for job in abandoned:  # only after a timeout: open their gates with an error
            job.fail(DeviceError("the CUDA backend closed before a staged copy finished"))
            self._finish(job)
        streams = self._streams
        with self._cond:
            chunks, self._chunks, self._free = self._chunks, [], []
            # Every batch released: the staging streams' work has completed. Otherwise (a
            # timeout) the pool reuses the chunks only after what is still queued on them.
            busy = bool(abandoned or self._active)
        for chunk in chunks:
            self.device.pinned.give(chunk.block, streams or () if busy else ())
        if streams is not None:
            if not busy:
                self._drain(streams, deadline)
            for s in streams:
                s.close()

    def _drain(self, streams: Sequence[CudaStream], deadline: float) -> None:
        """Wait (bounded, polling ``cuStreamQuery``: it never holds the context) until the
        staging streams are idle: the host functions behind the last events included, so that
        the device's final release finds no staging work in flight."""
        drv = driver()
        delay = 50e-6
        with ctx_current(self.device.ctx):
            for s in streams:
                while drv.cuStreamQuery(s.cu)[0] == drv.CUresult.CUDA_ERROR_NOT_READY:
                    if time.monotonic() > deadline:
                        return
                    time.sleep(delay)
                    delay = min(delay * 2, 5e-3)

    # -- workers -----------------------------------------------------------------------------
    def _start_workers(self) -> None:
        # Called with the lock held.
        while len(self._workers) < self.options.threads:
            t = threading.Thread(
                target=self._work,
                name=f"aioep-cuda-stage-{self.device.ordinal}-{len(self._workers)}",
                daemon=True,
            )
            self._workers.append(t)
            t.start()

    def _work(self) -> None:
        while True:
            task = self._next()
            if task is None:
                return
            try:
                task()
            except BaseException as exc:  # a bug: report it, keep the worker
                _report(exc)

    def _next(self) -> Callable[[], None] | None:
        with self._cond:
            while True:
                if self._stop:
                    return None
                if self._tasks:
                    return self._tasks.popleft()
                task = self._next_piece()
                if task is not None:
                    return task
                if self._closed and not self._active:
                    return None
                self._cond.wait()

    def _next_piece(self) -> Callable[[], None] | None:
        # Called with the lock held: start the head batch's next piece if it can start.
        while self._jobs:
            job = self._jobs[0]
            kind = job.peek_kind()
            if kind is None:  # every piece started
                self._jobs.popleft()
                if job.left == 0:  # an empty batch
                    return functools.partial(self._finish, job)
                continue
            if kind == HOST or not self._staged:
                return functools.partial(self._start, self._pop(job), None)
            if self._free:
                chunk = self._free.pop()
                return functools.partial(self._start, self._pop(job), chunk)
            if not self._allocating and len(self._chunks) < self._cap:
                # One allocation at a time: the pool checks its limit before it allocates.
                self._allocating += 1
                return functools.partial(self._start_new_chunk, self._pop(job))
            return None
        return None

    def _pop(self, job: StagedJob) -> _Piece:
        piece = job.pop()
        if job.peek_kind() is None:
            self._jobs.popleft()
        self.pieces += 1
        return piece

    def _start_new_chunk(self, piece: _Piece) -> None:
        try:
            block = self.device.pinned.take(self.options.chunk_bytes)
        except DeviceError as exc:
            with self._cond:
                self._allocating -= 1
                if self._chunks or self._allocating:
                    # The pinned pool is at its limit: make do with the chunks there are.
                    self._cap = max(1, len(self._chunks) + self._allocating)
                    self.pieces -= 1  # started again later
                    piece.job.back.appendleft(piece)
                    if not self._jobs or self._jobs[0] is not piece.job:
                        self._jobs.appendleft(piece.job)
                    self._cond.notify_all()
                    return
            piece.job.fail(
                DeviceError(
                    f"CUDA device {self.device.ordinal}: no pinned staging memory for a "
                    f"pageable copy ({exc})"
                )
            )
            self._piece_done(piece)
            return
        chunk = _Chunk(block)
        with self._cond:
            self._allocating -= 1
            self._chunks.append(chunk)
            self.peak_bytes = max(self.peak_bytes, sum(c.block.size for c in self._chunks))
        self._start(piece, chunk)

    def _start(self, piece: _Piece, chunk: _Chunk | None) -> None:
        piece.chunk = chunk
        n = piece.n
        if chunk is None and piece.kind != HOST:
            self._direct(piece)
        elif piece.kind == H2D:
            assert chunk is not None
            piece.to, piece.frm = chunk.view[:n], _bytes_at(piece.src, n)
            self._spread(piece)
        elif piece.kind == D2H:
            assert chunk is not None
            piece.to, piece.frm = _bytes_at(piece.dst, n), chunk.view[:n]
            self._download(piece)
        else:
            piece.to, piece.frm = _bytes_at(piece.dst, n), _bytes_at(piece.src, n)
            self._spread(piece)

    def _spread(self, piece: _Piece) -> None:
        """Split the piece's host copy into slices for the workers; run the first here."""
        n = piece.n
        k = max(1, min(self.options.threads, -(-n // MIN_SLICE_BYTES)))
        bounds = [n * i // k for i in range(k + 1)]
        piece.left = k
        if k > 1:
            with self._cond:
                for i in range(1, k):
                    self._tasks.append(
                        functools.partial(self._slice, piece, bounds[i], bounds[i + 1])
                    )
                self._cond.notify(k - 1)
        self._slice(piece, bounds[0], bounds[1])

    def _slice(self, piece: _Piece, a: int, b: int) -> None:
        try:
            if piece.job.error is None:
                assert piece.to is not None
                assert piece.frm is not None
                host_copy(piece.to[a:b], piece.frm[a:b])
        except BaseException as exc:
            piece.job.fail(exc)
        with self._cond:
            piece.left -= 1
            last = piece.left == 0
        if last:
            self._filled(piece)

    def _filled(self, piece: _Piece) -> None:
        chunk = piece.chunk
        if piece.kind == H2D and chunk is not None and piece.job.error is None:
            self._upload(piece, chunk)
        elif chunk is not None:
            self._release_chunk(chunk)
        piece.to = piece.frm = None
        self._piece_done(piece)

    def _upload(self, piece: _Piece, chunk: _Chunk) -> None:
        drv = driver()
        try:
            up, _ = self._get_streams()
            with up.lock, ctx_current(self.device.ctx):
                up.fence()
                check(
                    drv.cuMemcpyAsync(piece.dst, chunk.block.ptr, piece.n, up.cu),
                    f"cuMemcpyAsync(staged upload, {piece.n} bytes)",
                )
                up.enqueued()
                self._after(up, functools.partial(self._reuse, chunk))
        except BaseException as exc:
            piece.job.fail(exc)
            self._release_chunk(chunk)

    def _download(self, piece: _Piece) -> None:
        chunk = piece.chunk
        assert chunk is not None
        drv = driver()
        try:
            _, down = self._get_streams()
            with down.lock, ctx_current(self.device.ctx):
                down.fence()
                check(
                    drv.cuMemcpyAsync(chunk.block.ptr, piece.src, piece.n, down.cu),
                    f"cuMemcpyAsync(staged download, {piece.n} bytes)",
                )
                down.enqueued()
                self._after(down, functools.partial(self._landed, piece))
        except BaseException as exc:
            piece.job.fail(exc)
            self._filled(piece)

    def _landed(self, piece: _Piece, error: BaseException | None) -> None:
        # On the dispatcher thread: hand the host side to the workers.
        if error is not None:
            piece.job.fail(error)
        with self._cond:
            self._tasks.append(functools.partial(self._spread, piece))
            self._cond.notify()

    def _direct(self, piece: _Piece) -> None:
        """Unstaged (``chunks=0``): the driver's own pageable copy, issued by this worker."""
        try:
            up, down = self._get_streams()
            stream = up if piece.kind == H2D else down
            with stream.lock, ctx_current(self.device.ctx):
                stream.fence()
                check(
                    call_nogil("cuMemcpyAsync", piece.dst, piece.src, piece.n, int(stream.cu)),
                    f"cuMemcpyAsync(pageable, {piece.n} bytes)",
                )
                stream.enqueued()
        except BaseException as exc:
            piece.job.fail(exc)
        self._piece_done(piece)

    def _after(self, stream: CudaStream, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error)`` once the work enqueued on ``stream`` so far has completed (the
        dispatcher calls back; at once if the stream is idle or the record fails)."""
        try:
            note = stream.create_notification()
            note.activate()
        except (DeviceError, ClosedError) as exc:
            fn(exc)
            return

        def done() -> None:
            fn(note.error())

        try:
            note.add_done_callback(done)
        except ClosedError as exc:  # the factory is closing: its dispatcher stopped
            fn(exc)

    def _reuse(self, chunk: _Chunk, error: BaseException | None) -> None:
        # The upload from the chunk completed (or the context broke): the chunk is free.
        self._release_chunk(chunk)

    def _release_chunk(self, chunk: _Chunk) -> None:
        with self._cond:
            self._free.append(chunk)
            self._cond.notify()

    def _piece_done(self, piece: _Piece) -> None:
        job = piece.job
        with self._cond:
            job.left -= 1
            last = job.left == 0
        if last:
            self._finish(job)

    def _finish(self, job: StagedJob) -> None:
        stream: CudaStream | None
        try:
            up, down = self._get_streams()
            stream = up if job.h2d else down
        except BaseException as exc:  # no staging stream: nothing reached the device
            job.fail(exc)
            stream = None
        # The release mark is recorded (and armed) before ``on_done`` lets the caller's
        # stream go: once the caller sees the copy complete, this batch makes no driver
        # call any more (the environment may be closing its device right then).
        job.left = 2  # the release mark and on_done, in either order
        if stream is None:
            self._released(job, None)
        else:
            self._after(stream, functools.partial(self._released, job))
        # The host side is done: the host memory is let go now, before ``on_done`` lets the
        # caller see the copy complete (the caller may then close the environment, which
        # counts the buffers still alive).
        job.keep = ()
        on_done, job.on_done = job.on_done, None
        if on_done is not None:
            try:
                on_done(job, stream)
            except BaseException as exc:
                job.fail(exc)
        self._released(job, None)

    def _released(self, job: StagedJob, error: BaseException | None) -> None:
        if error is not None:
            job.fail(error)
        with self._cond:
            job.left -= 1
            if job.left:
                return
            self._active -= 1
            self._cond.notify_all()
        job.released.set()

    def _get_streams(self) -> tuple[CudaStream, CudaStream]:
        """The upload and download streams (made by the first worker that needs them)."""
        with self._streams_lock:
            if self._streams is None:
                up = CudaStream(self.device, self._dispatcher, wake=self._wake, owner=self._owner)
                try:
                    down = CudaStream(
                        self.device, self._dispatcher, wake=self._wake, owner=self._owner
                    )
                except BaseException:
                    up.close()
                    raise
                self._streams = (up, down)
            return self._streams

    def stats(self) -> dict[str, int]:
        """Counters for benchmarks and diagnostics."""
        with self._cond:
            held = sum(c.block.size for c in self._chunks)
        return {
            "chunk_bytes": self.options.chunk_bytes,
            "chunks": self.options.chunks,
            "threads": self.options.threads,
            "bound_bytes": self.options.bound,
            "held_bytes": held,
            "peak_bytes": self.peak_bytes,
            "jobs": self.jobs,
            "pieces": self.pieces,
        }


class Staging:
    """A factory's stagers, one per device (made on first use), all with the same options."""

    def __init__(self, options: StagingOptions, dispatcher: Dispatcher, *, wake: str, owner: Any):
        self.options = options
        self._dispatcher = dispatcher
        self._wake = wake
        self._owner = owner
        self._lock = threading.Lock()
        self._stagers: dict[int, Stager] = {}
        self._closed = False

    def stager(self, device: CudaDevice) -> Stager:
        """The device's stager (a closed one after `close`: its submit refuses)."""
        with self._lock:
            s = self._stagers.get(device.ordinal)
            if s is None:
                s = Stager(
                    device, self._dispatcher, self.options, wake=self._wake, owner=self._owner
                )
                if self._closed:
                    s.close()
                else:
                    self._stagers[device.ordinal] = s
            return s

    def stagers(self) -> list[Stager]:
        """The stagers made so far."""
        with self._lock:
            return list(self._stagers.values())

    def close(self) -> None:
        """Close every stager (see `Stager.close`); idempotent."""
        with self._lock:
            self._closed = True
            stagers = list(self._stagers.values())
        for s in stagers:
            s.close()
