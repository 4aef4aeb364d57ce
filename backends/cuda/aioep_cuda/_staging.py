"""Pageable host memory through pinned staging chunks.

CUDA copies pageable host memory through the driver's own small staging buffer, on the
calling thread: a 1 GiB upload ran at 9.3 GB/s on an H200, against 55 GB/s from pinned
memory. A `Stager` (one per device and environment, made on first use) moves
pageable sources and destinations through a bounded set of pinned *chunks* taken from the
device's pinned pool, with ``threads`` worker threads. It is three parts and a queue:

* a worker pool (`._workers.WorkerPool`): the threads, started on first use;
* a chunk pool (`._chunks.ChunkPool`): at most ``chunks`` chunks, made one at a time;
* a piece machine (`._pieces.PieceMachine`): each pair is cut into *pieces* of at most one
  chunk, and each piece runs along the route of its kind (`PieceKind`): an **upload**
  piece is copied by the workers into a chunk (in slices: numpy copies release the GIL),
  then ``cuMemcpyAsync`` from the chunk on the stager's upload stream; the chunk is free
  once that copy has completed (the factory's dispatcher calls back, as for every
  notification: no thread waits for it). A **download** piece is copied into a chunk on the
  download stream, then, once it has landed, by the workers into the destination. A
  **host** piece (pageable <-> pinned memory) is copied by the workers directly;
* the batches (`StagedJob`) wait in submission order for chunks.

While one chunk is being filled or drained on the host, the others are on the device:
host copies and device copies overlap. The pieces of one batch run in any order (they
never overlap: the core validated the batch); batches are served in submission order.
A batch is done when its last upload is enqueued and its last download has landed in
host memory: its ``on_done`` runs then, on a worker (the transfer opens the caller's
stream gate there, see `._transfer`), and its host memory is let go; it is
*released* once the device work enqueued up to then has completed too (two steps,
`ReleaseStep`). Staging memory is bounded: at most ``chunks`` chunks of ``chunk_bytes`` per
device (rounded up to the pinned pool's size class), whatever the number of copies in
flight (more copies queue for chunks, in submission order).

``chunks=0`` turns staging off: each pair is one ``cuMemcpyAsync`` of the pageable memory
issued by a worker (the driver's own staging, synchronous for the worker): the baseline.

Nothing here blocks the event loop: `Stager.submit` appends to a queue.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioep import DeviceError

from ._chunks import ChunkPool
from ._pieces import (
    OnDone,
    Piece,
    PieceKind,
    PieceMachine,
    ReleaseStep,
    StagedJob,
    StagedPair,
    StagingStreams,
    after,
)
from ._pool import size_class
from ._stream import CudaStream
from ._workers import Task, WorkerPool

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
    "PieceKind",
    "ReleaseStep",
    "StagedJob",
    "StagedPair",
    "Stager",
    "Staging",
    "StagingOptions",
]

H2D, D2H, HOST = PieceKind.H2D, PieceKind.D2H, PieceKind.HOST
"""The piece kinds by their short names."""

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_CHUNKS = 4
DEFAULT_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Defaults from one measurement on an H200 host (8 threads, 64 MiB chunks, 4 in flight:
26.5 GB/s up, 27.8 GB/s down); provisional until ``benchmarks/cuda_pageable.py`` has
measured this implementation on a GPU."""

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
        self._staged = options.chunks > 0
        self._cond = threading.Condition()
        self._jobs: collections.deque[StagedJob] = collections.deque()
        self._active = 0  # batches submitted and not released
        self._closed = False
        self._streams = StagingStreams(device, dispatcher, wake=wake, owner=owner)
        self._chunks = ChunkPool(device.pinned, options.chunk_bytes, options.chunks, self._cond)
        self._workers = WorkerPool(
            f"aioep-cuda-stage-{device.ordinal}",
            options.threads,
            self._cond,
            self._next_task,
            lambda: not self._active,
        )
        self._machine = PieceMachine(
            device,
            self._workers,
            self._chunks,
            self._streams,
            self._cond,
            options.threads,
            self._piece_done,
        )
        self.jobs = 0
        """Batches submitted so far."""
        self.pieces = 0
        """Pieces (chunk-sized copies) started so far."""

    # -- public ------------------------------------------------------------------------------
    @property
    def peak_bytes(self) -> int:
        """Most pinned staging memory held at once so far (bytes)."""
        return self._chunks.peak_bytes

    @property
    def held_bytes(self) -> int:
        """Pinned staging memory held now (bytes)."""
        with self._cond:
            return self._chunks.held_bytes

    def submit(
        self,
        pairs: Sequence[StagedPair],
        keep: Sequence[Any],
        on_done: OnDone | None = None,
    ) -> StagedJob | None:
        """Queue a batch of pairs whose prerequisites are done; ``keep``: the host memory's
        owners, kept alive until the workers are done with it (the device memory must be
        kept alive by the caller until the batch's device work has completed). Never
        blocks. None if the stager is closed (nothing was queued)."""
        step = self.options.chunk_bytes if self._staged else None
        job = StagedJob(pairs, keep, on_done, step)
        with self._cond:
            if self._closed:
                return None
            self._active += 1
            self.jobs += 1
            self._jobs.append(job)
            self._workers.start()
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
        deadline = time.monotonic() + CLOSE_TIMEOUT
        self._workers.close(deadline)
        with self._cond:
            self._workers.stop()
            abandoned = list(self._jobs)
            self._jobs.clear()
        for job in abandoned:  # only after a timeout: open their gates with an error
            job.fail(DeviceError("the CUDA backend closed before a staged copy finished"))
            self._finish(job)
        streams = self._streams.made
        with self._cond:
            # Every batch released: the staging streams' work has completed. Otherwise (a
            # timeout) the pool reuses the chunks only after what is still queued on them.
            busy = bool(abandoned or self._active)
        self._chunks.close(streams or () if busy else ())
        if streams is not None:
            if not busy:
                self._streams.drain(deadline)
            self._streams.close()

    def stats(self) -> dict[str, int]:
        """Counters for benchmarks and diagnostics."""
        return {
            "chunk_bytes": self.options.chunk_bytes,
            "chunks": self.options.chunks,
            "threads": self.options.threads,
            "bound_bytes": self.options.bound,
            "held_bytes": self.held_bytes,
            "peak_bytes": self.peak_bytes,
            "jobs": self.jobs,
            "pieces": self.pieces,
        }

    # -- scheduling: the head batch's next piece, once it has a chunk ------------------------
    def _next_task(self) -> Task | None:
        # The workers' source, called with the lock held.
        while self._jobs:
            job = self._jobs[0]
            kind = job.peek_kind()
            if kind is None:  # every piece started: an empty batch
                self._jobs.popleft()
                if job.pieces_left == 0:
                    return functools.partial(self._finish, job)
                continue
            if kind is PieceKind.HOST or not self._staged:
                return functools.partial(self._machine.start, self._pop(job), None)
            chunk = self._chunks.take()
            if chunk is not None:
                return functools.partial(self._machine.start, self._pop(job), chunk)
            if self._chunks.may_make():
                return functools.partial(self._start_with_new_chunk, self._pop(job))
            return None
        return None

    def _pop(self, job: StagedJob) -> Piece:
        piece = job.pop()
        if job.peek_kind() is None:
            self._jobs.popleft()
        self.pieces += 1
        return piece

    def _start_with_new_chunk(self, piece: Piece) -> None:
        try:
            chunk = self._chunks.make()
        except DeviceError as exc:
            with self._cond:
                if self._chunks.unmade():
                    # The pinned pool is at its limit: make do with the chunks there are.
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
        self._chunks.made(chunk)
        self._machine.start(piece, chunk)

    # -- a batch's end and its two-step release ----------------------------------------------
    def _piece_done(self, piece: Piece) -> None:
        job = piece.job
        with self._cond:
            job.pieces_left -= 1
            last = job.pieces_left == 0
        if last:
            self._finish(job)

    def _finish(self, job: StagedJob) -> None:
        with self._cond:
            if job.finishing:
                return
            job.finishing = True
        stream: CudaStream | None
        try:
            pair = self._streams.get()
            stream = pair.upload if job.h2d else pair.download
        except BaseException as exc:  # no staging stream: nothing reached the device
            job.fail(exc)
            stream = None
        # The release mark is recorded (and armed) before ``on_done`` lets the caller's
        # stream go: once the caller sees the copy complete, this batch makes no driver
        # call any more (the environment may be closing its device right then).
        device_done = functools.partial(self._released, job, ReleaseStep.DEVICE_DONE)
        if stream is None:
            device_done(None)
        else:
            after(stream, device_done)
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
        self._released(job, ReleaseStep.HANDED_OVER, None)

    def _released(self, job: StagedJob, step: ReleaseStep, error: BaseException | None) -> None:
        if error is not None:
            job.fail(error)
        with self._cond:
            if step not in job.release_pending:
                return
            job.release_pending.discard(step)
            if job.release_pending:
                return
            self._active -= 1
            self._cond.notify_all()
        job.released.set()


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
