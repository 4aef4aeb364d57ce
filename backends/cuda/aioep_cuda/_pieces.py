"""Pieces of staged copies and the machine that runs them (`PieceMachine`).

A pair (`StagedPair`) is cut into pieces of at most one chunk. Each piece runs along the
route of its kind (`ROUTES`), one phase after the other:

* ``H2D`` staged: `Phase.HOST_COPY` (the workers copy the pageable bytes into the chunk, in
  slices), then `Phase.UPLOAD` (``cuMemcpyAsync`` from the chunk on the upload stream: the
  piece is done once it is enqueued; the chunk is free once it has run);
* ``D2H`` staged: `Phase.DOWNLOAD` (``cuMemcpyAsync`` into the chunk on the download stream;
  the dispatcher calls back once it has landed), then `Phase.HOST_COPY` (chunk to pageable);
* ``HOST`` (pageable <-> pinned host memory): `Phase.HOST_COPY` alone;
* ``H2D``/``D2H`` unstaged (no chunk: ``chunks=0``): `Phase.DRIVER_COPY` (the driver's own
  pageable copy, issued by a worker).

A piece gives its chunk back when its route ends, unless it handed the chunk to the device
(an upload). No thread waits for the device: completions come back through the factory's
dispatcher (`after`).
"""

from __future__ import annotations

import collections
import enum
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from aioep import ClosedError, DeviceError

from ._chunks import Chunk, ChunkPool, bytes_at
from ._driver import call_nogil, check, ctx_current, driver
from ._stream import CudaStream
from ._workers import WorkerPool

if TYPE_CHECKING:
    from ._device import CudaDevice
    from ._wake import Dispatcher

__all__ = [
    "MIN_SLICE_BYTES",
    "ROUTES",
    "OnDone",
    "Phase",
    "Piece",
    "PieceKind",
    "PieceMachine",
    "ReleaseStep",
    "StagedJob",
    "StagedPair",
    "StagingStreams",
    "StreamPair",
    "after",
    "host_copy",
]

MIN_SLICE_BYTES = 1 << 20
"""A host copy is split among the workers in slices of at least this size."""


class PieceKind(enum.Enum):
    """Which way a staged pair copies."""

    H2D = "pageable -> device"
    D2H = "device -> pageable"
    HOST = "pageable <-> pinned host memory"


class StagedPair(NamedTuple):
    """One pair for the stager: ``nbytes`` from address ``src`` to address ``dst``."""

    kind: PieceKind
    dst: int
    src: int
    nbytes: int


class Phase(enum.Enum):
    """One step of a piece's route (see the module docstring)."""

    HOST_COPY = "host copy"
    UPLOAD = "upload"
    DOWNLOAD = "download"
    DRIVER_COPY = "driver copy"


ROUTES: dict[tuple[PieceKind, bool], tuple[Phase, ...]] = {
    (PieceKind.H2D, True): (Phase.HOST_COPY, Phase.UPLOAD),
    (PieceKind.D2H, True): (Phase.DOWNLOAD, Phase.HOST_COPY),
    (PieceKind.HOST, True): (Phase.HOST_COPY,),
    (PieceKind.H2D, False): (Phase.DRIVER_COPY,),
    (PieceKind.D2H, False): (Phase.DRIVER_COPY,),
    (PieceKind.HOST, False): (Phase.HOST_COPY,),
}
"""Each piece's phases, by (kind, whether it has a chunk)."""


def host_copy(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> None:
    """The host side of one slice (numpy releases the GIL for it). Workers look it up at
    each call, so a test may replace it (a slow host thread)."""
    np.copyto(dst, src)


class Piece:
    """At most one chunk of one pair: ``n`` bytes from address ``src`` to address ``dst``.

    ``route`` and ``step``: its phases and the one it is in (-1: not started). ``to`` and
    ``frm``: the host views its slices copy between, during `Phase.HOST_COPY`."""

    __slots__ = (
        "chunk",
        "dst",
        "frm",
        "job",
        "kind",
        "n",
        "route",
        "slices_left",
        "src",
        "step",
        "to",
    )

    def __init__(self, job: StagedJob, kind: PieceKind, dst: int, src: int, n: int) -> None:
        self.job, self.kind, self.dst, self.src, self.n = job, kind, dst, src, n
        self.chunk: Chunk | None = None
        self.route: tuple[Phase, ...] = ()
        self.step = -1
        self.slices_left = 0
        self.to: npt.NDArray[np.uint8] | None = None
        self.frm: npt.NDArray[np.uint8] | None = None


class ReleaseStep(enum.Enum):
    """What a finished batch waits for before it is released (both, in either order)."""

    DEVICE_DONE = "the device work enqueued up to the batch's end has completed"
    HANDED_OVER = "its on_done has returned"


OnDone = Callable[["StagedJob", "CudaStream | None"], None]


class StagedJob:
    """One submitted batch of pageable pairs.

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
        "finishing",
        "h2d",
        "keep",
        "on_done",
        "pieces_left",
        "release_pending",
        "released",
    )

    def __init__(
        self,
        pairs: Sequence[StagedPair],
        keep: Sequence[Any],
        on_done: OnDone | None,
        step: int | None,
    ) -> None:
        self._pairs = [p for p in pairs if p.nbytes > 0]
        self._step = step
        self._cursor = (0, 0)  # (pair index, offset) of the next piece to start
        self.back: collections.deque[Piece] = collections.deque()  # pieces put back
        self.keep: Sequence[Any] = keep
        self.on_done: OnDone | None = on_done
        self.error: BaseException | None = None
        self.released = threading.Event()
        self.h2d = any(p.kind is PieceKind.H2D for p in self._pairs)
        self.pieces_left = sum(self._count(p) for p in self._pairs)
        """Pieces not finished yet."""
        self.finishing = False
        """Every piece finished (or the batch was abandoned): its release has begun."""
        self.release_pending = set(ReleaseStep)
        """The steps of its release still to come."""

    def _size(self, pair: StagedPair) -> int:
        if self._step is None and pair.kind is not PieceKind.HOST:
            return pair.nbytes  # unstaged: one driver copy per pair
        return self._step or pair.nbytes

    def _count(self, pair: StagedPair) -> int:
        return -(-pair.nbytes // self._size(pair))

    def fail(self, exc: BaseException) -> None:
        """Record the batch's first failure."""
        if self.error is None:
            self.error = exc

    def peek_kind(self) -> PieceKind | None:
        """The kind of the next piece to start, or None when every piece has started."""
        if self.back:
            return self.back[0].kind
        i = self._cursor[0]
        return self._pairs[i].kind if i < len(self._pairs) else None

    def pop(self) -> Piece:
        """The next piece to start (call only after `peek_kind` gave a kind)."""
        if self.back:
            return self.back.popleft()
        i, off = self._cursor
        pair = self._pairs[i]
        m = min(self._size(pair), pair.nbytes - off)
        self._cursor = (i, off + m) if off + m < pair.nbytes else (i + 1, 0)
        return Piece(self, pair.kind, pair.dst + off, pair.src + off, m)


class StreamPair(NamedTuple):
    """A stager's two streams: uploads on one, downloads on the other."""

    upload: CudaStream
    download: CudaStream

    def for_kind(self, kind: PieceKind) -> CudaStream:
        """The stream that copies pieces of ``kind`` to or from the device."""
        return self.upload if kind is PieceKind.H2D else self.download


class StagingStreams:
    """A stager's `StreamPair`, made by the first worker that needs it (never the loop)."""

    def __init__(self, device: CudaDevice, dispatcher: Dispatcher, *, wake: str, owner: Any):
        self._device = device
        self._dispatcher = dispatcher
        self._wake = wake
        self._owner = owner
        self._lock = threading.Lock()
        self._pair: StreamPair | None = None

    def get(self) -> StreamPair:
        """The streams, made now if need be (raises `aioep.DeviceError` if they cannot be)."""
        with self._lock:
            if self._pair is None:
                up = self._new()
                try:
                    down = self._new()
                except BaseException:
                    up.close()
                    raise
                self._pair = StreamPair(up, down)
            return self._pair

    def _new(self) -> CudaStream:
        return CudaStream(self._device, self._dispatcher, wake=self._wake, owner=self._owner)

    @property
    def made(self) -> StreamPair | None:
        """The streams if they were made."""
        return self._pair

    def drain(self, deadline: float) -> None:
        """Wait (bounded by ``deadline``, polling ``cuStreamQuery``: it never holds the
        context) until both streams are idle, the host functions behind their last events
        included. Call off the event loop, after the last work was enqueued."""
        pair = self._pair
        if pair is None:
            return
        drv = driver()
        delay = 50e-6
        with ctx_current(self._device.ctx):
            for s in pair:
                while drv.cuStreamQuery(s.cu)[0] == drv.CUresult.CUDA_ERROR_NOT_READY:
                    if time.monotonic() > deadline:
                        return
                    time.sleep(delay)
                    delay = min(delay * 2, 5e-3)

    def close(self) -> None:
        """Destroy the streams (their queued work still runs)."""
        pair = self._pair
        if pair is not None:
            for s in pair:
                s.close()


def after(stream: CudaStream, fn: Callable[[BaseException | None], None]) -> None:
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


class PieceMachine:
    """Runs pieces along their routes (see the module docstring) on the stager's workers.

    Args:
        device: the GPU (its context for the driver copies).
        workers: the stager's workers (they run the slices and the landed downloads).
        chunks: where a piece's chunk goes back.
        streams: the stager's streams.
        cond: the stager's lock.
        threads: how many slices a host copy is split into at most.
        done: called once per piece, on the thread that ends its route.
    """

    def __init__(
        self,
        device: CudaDevice,
        workers: WorkerPool,
        chunks: ChunkPool,
        streams: StagingStreams,
        cond: threading.Condition,
        threads: int,
        done: Callable[[Piece], None],
    ) -> None:
        self._device = device
        self._workers = workers
        self._chunks = chunks
        self._streams = streams
        self._cond = cond
        self._threads = threads
        self._done = done

    def start(self, piece: Piece, chunk: Chunk | None) -> None:
        """Run ``piece`` from its first phase, with ``chunk`` (None: unstaged, or a host
        piece, which needs none)."""
        piece.chunk = chunk
        piece.route = ROUTES[piece.kind, chunk is not None]
        piece.step = -1
        self._advance(piece)

    def _advance(self, piece: Piece) -> None:
        """Go on to the piece's next phase, or end its route."""
        piece.step += 1
        if piece.step == len(piece.route):
            self._end(piece)
            return
        phase = piece.route[piece.step]
        if phase is Phase.HOST_COPY:
            self._host_copy(piece)
        elif phase is Phase.UPLOAD:
            self._upload(piece)
        elif phase is Phase.DOWNLOAD:
            self._download(piece)
        else:
            self._driver_copy(piece)

    def _end(self, piece: Piece) -> None:
        if piece.chunk is not None:
            self._chunks.give(piece.chunk)
            piece.chunk = None
        piece.to = piece.frm = None
        self._done(piece)

    # -- host copies -------------------------------------------------------------------------
    def _host_copy(self, piece: Piece) -> None:
        """Split the copy into slices for the workers; run the first one here."""
        n, chunk = piece.n, piece.chunk
        if piece.kind is PieceKind.H2D:
            assert chunk is not None
            piece.to, piece.frm = chunk.view[:n], bytes_at(piece.src, n)
        elif piece.kind is PieceKind.D2H:
            assert chunk is not None
            piece.to, piece.frm = bytes_at(piece.dst, n), chunk.view[:n]
        else:
            piece.to, piece.frm = bytes_at(piece.dst, n), bytes_at(piece.src, n)
        k = max(1, min(self._threads, -(-n // MIN_SLICE_BYTES)))
        bounds = [n * i // k for i in range(k + 1)]
        piece.slices_left = k
        if k > 1:
            slices = [
                functools.partial(self._slice, piece, bounds[i], bounds[i + 1]) for i in range(1, k)
            ]
            with self._cond:
                self._workers.push(*slices)
        self._slice(piece, bounds[0], bounds[1])

    def _slice(self, piece: Piece, a: int, b: int) -> None:
        try:
            if piece.job.error is None:
                assert piece.to is not None
                assert piece.frm is not None
                host_copy(piece.to[a:b], piece.frm[a:b])
        except BaseException as exc:
            piece.job.fail(exc)
        with self._cond:
            piece.slices_left -= 1
            last = piece.slices_left == 0
        if last:
            piece.to = piece.frm = None
            self._advance(piece)

    # -- device copies -----------------------------------------------------------------------
    def _upload(self, piece: Piece) -> None:
        """Enqueue the chunk's upload (not after a failure); the chunk goes to the device."""
        chunk = piece.chunk
        assert chunk is not None
        if piece.job.error is None:
            try:
                up = self._streams.get().upload
                with up.lock, ctx_current(self._device.ctx):
                    up.fence()
                    check(
                        driver().cuMemcpyAsync(piece.dst, chunk.block.ptr, piece.n, up.cu),
                        f"cuMemcpyAsync(staged upload, {piece.n} bytes)",
                    )
                    up.enqueued()
                    after(up, functools.partial(self._reuse, chunk))
                    piece.chunk = None  # free again once the upload has run
            except BaseException as exc:
                piece.job.fail(exc)
        self._advance(piece)

    def _reuse(self, chunk: Chunk, error: BaseException | None) -> None:
        # The upload from the chunk completed (or the context broke): the chunk is free.
        self._chunks.give(chunk)

    def _download(self, piece: Piece) -> None:
        """Enqueue the download into the chunk; the host copy follows once it has landed."""
        chunk = piece.chunk
        assert chunk is not None
        try:
            down = self._streams.get().download
            with down.lock, ctx_current(self._device.ctx):
                down.fence()
                check(
                    driver().cuMemcpyAsync(chunk.block.ptr, piece.src, piece.n, down.cu),
                    f"cuMemcpyAsync(staged download, {piece.n} bytes)",
                )
                down.enqueued()
                after(down, functools.partial(self._landed, piece))
        except BaseException as exc:
            piece.job.fail(exc)
            self._end(piece)

    def _landed(self, piece: Piece, error: BaseException | None) -> None:
        # On the dispatcher thread: hand the host copy to the workers.
        if error is not None:
            piece.job.fail(error)
        with self._cond:
            self._workers.push(functools.partial(self._advance, piece))

    def _driver_copy(self, piece: Piece) -> None:
        """Unstaged (``chunks=0``): the driver's own pageable copy, issued by this worker."""
        try:
            stream = self._streams.get().for_kind(piece.kind)
            with stream.lock, ctx_current(self._device.ctx):
                stream.fence()
                check(
                    call_nogil("cuMemcpyAsync", piece.dst, piece.src, piece.n, int(stream.cu)),
                    f"cuMemcpyAsync(pageable, {piece.n} bytes)",
                )
                stream.enqueued()
        except BaseException as exc:
            piece.job.fail(exc)
        self._advance(piece)
