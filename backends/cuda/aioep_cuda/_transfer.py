"""Copies between host, pinned and device memory with ``cuMemcpyAsync``.

Pinned and device memory: every pair of a batch is enqueued on the one stream
and the call returns at once. Pageable host memory is the exception: CUDA
copies it synchronously (H2D returns once the data is staged, D2H once it has
landed), and slowly (one thread, the driver's small staging buffer). Pageable
pairs go through the device's `Stager` instead: pinned
staging chunks, host copies spread over worker threads, device copies from the
chunks overlapped with them. Without a stream a batch of pinned and device memory is
enqueued on the transfer's own stream of the device
(`CudaDataTransfer.enqueue_unstreamed`: no thread hop, the dispatcher wakes the
awaiter); a batch with pageable memory runs on the core's worker thread, which waits for
the staged pairs. With a stream the
pageable pairs go through a *gate*:

1. on the caller's stream S: record an event (the work before the copy), then
   ``cuStreamWaitValue32(S, gate, k, GEQ)``: later work on S waits on the device;
2. when that event completes (the dispatcher wakes us, no thread blocks for it)
   the batch goes to the stager; once its uploads are enqueued and its downloads
   have landed in host memory, a worker enqueues ``cuStreamWriteValue32(gate, k)``
   on the stager's upload stream, after the uploads: S goes on once the data has
   moved.

Stream order is kept exactly as for any other copy on S: later work on S sees the
data, and a staged copy *out of* a host array that an earlier staged copy on S
writes starts only once S has passed that copy's gate, that is once the bytes are
in the array (the ordering is on the device, through S itself; nothing waits on the
host). The loop never blocks, and no thread ever waits on a stream that could
itself be waiting for that thread (no deadlock across streams). Where stream
memory operations are unsupported, the pageable pairs are copied on the calling
thread (documented fallback).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from aioep import DeviceError, DeviceType, MemoryDevice, MemoryType, Tensor
from aioep.abc import CopyPair, DataTransfer, StreamImpl

from ._device import NVIDIA_VENDOR_ID, CudaDevice
from ._driver import call_nogil, check, ctx_current, driver, error_name
from ._staging import D2H, H2D, HOST, PieceKind, StagedJob, StagedPair, Staging
from ._stream import CudaNotification, CudaStream

__all__ = ["CudaDataTransfer", "PageableCopier"]

_Loc = tuple[str, CudaDevice | None]  # ("device", dev) | ("pinned", None) | ("pageable", None)


class PageableCopier:
    """Stream-gated pageable copies: keeps the gates whose prerequisites have not completed
    (to open them at close) and hands ready ones to the device's `Stager`."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self._lock = threading.Lock()
        self._waiting: set[_GateJob] = set()

    def submit(self, job: _GateJob) -> None:
        """Stage a ready job (its prerequisites on its stream are complete); never blocks."""
        try:
            stager = self.staging.stager(job.stream.device)
            staged = stager.submit(job.pairs, job.keep, functools.partial(_open_gate, job))
        except BaseException as exc:  # a bug: never leave the stream gated
            staged = None
            job.stream.gate_errors[job.value] = exc.with_traceback(None)
        job.keep = ()
        if staged is None:
            # Never leave the stream gated: release it without copying.
            job.stream.gate_errors.setdefault(
                job.value, DeviceError("the CUDA backend closed before a copy ran")
            )
            self._release(job.stream, job.addr, job.value)
            job.stream.gate_settled(job.value)

    def track(self, job: _GateJob) -> None:
        """Note a gate job whose prerequisites have not completed yet."""
        with self._lock:
            self._waiting.add(job)

    def untrack(self, job: _GateJob) -> None:
        """The job was submitted (or abandoned)."""
        with self._lock:
            self._waiting.discard(job)

    @staticmethod
    def _release(stream: CudaStream, addr: int, value: int) -> None:
        drv = driver()
        dev = stream.device
        try:
            with ctx_current(dev.ctx):
                check(
                    drv.cuStreamWriteValue32(dev.side_stream(), addr, value & 0xFFFFFFFF, 0),
                    "cuStreamWriteValue32",
                )
        except BaseException as exc:  # the context is broken: S fails with it too
            stream.gate_errors.setdefault(value, exc.with_traceback(None))

    def close(self) -> None:
        """Open every gate whose prerequisites have not completed yet (a stream still held
        on the device, or failed) without its copy (its futures fail with a
        `DeviceError`), so that no stream of the context waits for a copy that will
        never run; idempotent. The staged jobs already queued finish (`Staging.close`)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), set()
        for job in sorted(waiting, key=lambda j: j.value):
            job.abandon()


def _open_gate(job: _GateJob, staged: StagedJob, stream: CudaStream | None) -> None:
    """The staged copies of ``job`` are done (uploads enqueued on ``stream``): let the
    caller's stream go on the device once they have landed."""
    try:
        if staged.error is not None:  # kept without its traceback (which holds tensors)
            job.stream.gate_errors[job.value] = staged.error.with_traceback(None)
        if stream is None:  # no staging stream could be made: nothing was copied
            PageableCopier._release(job.stream, job.addr, job.value)
            return
        drv = driver()
        try:
            with stream.lock, ctx_current(stream.device.ctx):
                check(
                    drv.cuStreamWriteValue32(stream.cu, job.addr, job.value & 0xFFFFFFFF, 0),
                    "cuStreamWriteValue32",
                )
                stream.enqueued()
        except BaseException as exc:  # the context is broken: S fails with it too
            job.stream.gate_errors.setdefault(job.value, exc.with_traceback(None))
    finally:
        # The stager recorded the batch's release mark before calling this: the copy makes
        # no more driver calls, and S's later notifications may complete (gate_pending).
        job.stream.gate_settled(job.value)


class _GateJob:
    """Runs a gated pageable copy once both its prerequisites completed and its gate is set."""

    __slots__ = (
        "_copier",
        "_done",
        "_fired",
        "_lock",
        "_ready",
        "addr",
        "keep",
        "pairs",
        "stream",
        "value",
    )

    def __init__(
        self,
        copier: PageableCopier,
        stream: CudaStream,
        pairs: list[StagedPair],
        keep: list[Tensor],
        addr: int,
        value: int,
    ) -> None:
        self._copier = copier
        self._lock = threading.Lock()
        self._fired = self._ready = self._done = False
        self.stream, self.pairs, self.addr, self.value = stream, pairs, addr, value
        self.keep: Sequence[Tensor] = keep

    def _go(self) -> bool:
        # Called with the lock held: True exactly once, when both conditions hold.
        if self._fired and self._ready and not self._done:
            self._done = True
            return True
        return False

    def prerequisites_done(self) -> None:
        with self._lock:
            self._fired = True
            go = self._go()
        if go:
            self._copier.untrack(self)
            self._copier.submit(self)

    def gate_enqueued(self) -> None:
        with self._lock:
            self._ready = True
            go = self._go()
        if go:
            self._copier.untrack(self)
            self._copier.submit(self)

    def abandon(self) -> None:
        """At close: open the gate without copying (the copy's futures fail)."""
        with self._lock:
            if self._done or not self._ready:
                return
            self._done = True
        self.keep = ()
        self.stream.gate_errors[self.value] = DeviceError(
            "the CUDA backend closed before a pageable copy's stream reached it"
        )
        PageableCopier._release(self.stream, self.addr, self.value)
        self.stream.gate_settled(self.value)


class CudaDataTransfer(DataTransfer):
    """H2D, D2H and D2D (same device and peer) copies, pinned or pageable host memory.

    Never copies on the event loop (``can_copy_inline`` stays False): every copy is a
    driver call that may wait on the driver's lock.
    """

    def __init__(self, devices: Mapping[int, CudaDevice], owner: Any, staging: Staging) -> None:
        self._devices = dict(devices)
        self._owner = owner
        self._pageable = PageableCopier(staging)
        self._stream_mem_ops = True
        self._peer_done: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._own_streams: dict[int, CudaStream] = {}  # device ordinal -> un-streamed copies
        self._closed = False

    # -- routing ---------------------------------------------------------------------------
    def _ours(self, d: MemoryDevice) -> bool:
        return (
            d.device_type is DeviceType.GPU
            and d.vendor_id == NVIDIA_VENDOR_ID
            and d.device_id in self._devices
        )

    def can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        def ok(d: MemoryDevice) -> bool:
            return self._ours(d) or d.device_type is DeviceType.CPU

        return ok(src) and ok(dst) and (self._ours(src) or self._ours(dst))

    def can_use_stream(self, stream: StreamImpl) -> bool:
        return isinstance(stream, CudaStream) and stream.owner is self._owner

    def _locate(self, device: MemoryDevice, ptr: int) -> _Loc:
        if self._ours(device):
            if device.memory_type is MemoryType.DEFAULT:
                return ("device", self._devices[device.device_id])
            return ("pinned", None)
        return ("pinned", None) if _is_page_locked(ptr) else ("pageable", None)

    # -- copying ---------------------------------------------------------------------------
    def copy_tensors(self, pairs: Sequence[CopyPair], stream: StreamImpl | None) -> None:
        if stream is not None:
            assert isinstance(stream, CudaStream)
            self._enqueue(pairs, stream)
            return
        # Synchronous (the core runs this on a worker thread): this thread's own stream;
        # pageable pairs through the stager, at the same time.
        dev = self._batch_device(pairs)
        staged, keep, direct = self._split(pairs)
        job: StagedJob | None = None
        if staged:
            job = self._pageable.staging.stager(dev).submit(staged, keep)
            if job is None:
                raise DeviceError("the CUDA backend is closed")
        try:
            if direct:
                cu, event, seen = dev.copy_stream()
                drv = driver()
                seen[0] = dev.shared.fence(cu, seen[0])
                with ctx_current(dev.ctx):
                    for s, d in direct:
                        self._memcpy(d, s, cu)
                    check(drv.cuEventRecord(event, cu), "cuEventRecord")
                    # A blocking-sync event: the thread sleeps in the driver, it does not spin.
                    check(call_nogil("cuEventSynchronize", int(event)), "cuEventSynchronize")
        finally:
            # Even when the direct pairs failed: the caller lets the memory go on return,
            # and the stager may still be copying it. (An empty batch runs inline on the
            # event loop: it must not wait for anything, and has no job.)
            if job is not None:
                job.released.wait()
        if job is not None and job.error is not None:
            raise job.error

    def _split(
        self, pairs: Sequence[CopyPair]
    ) -> tuple[list[StagedPair], list[Tensor], list[CopyPair]]:
        """(the staged pairs, their host tensors, the other pairs); empty pairs are
        dropped."""
        staged: list[StagedPair] = []
        keep: list[Tensor] = []
        direct: list[CopyPair] = []
        for s, d in pairs:
            if not s.nbytes:
                continue
            kind = self._staged_kind(s, d)
            if kind is None:
                direct.append((s, d))
            else:
                staged.append(StagedPair(kind, d.data_ptr, s.data_ptr, s.nbytes))
                # The host memory the staging threads read or write: kept until they are
                # done with it, even if the copy's future failed first (a broken context).
                # Device memory needs no such hold: the copy's future (or the synchronous
                # caller) keeps it until the staged device copies have completed.
                keep += (s, d) if kind == HOST else (s if kind == H2D else d,)
        return staged, keep, direct

    def _staged_kind(self, s: Tensor, d: Tensor) -> PieceKind | None:
        """H2D, D2H or HOST for a pair with a pageable side, else None."""
        src = self._locate(s.device, s.data_ptr)[0]
        dst = self._locate(d.device, d.data_ptr)[0]
        if src == "pageable":
            return H2D if dst == "device" else HOST
        if dst == "pageable":
            return D2H if src == "device" else HOST
        return None

    def enqueue_unstreamed(self, pairs: Sequence[CopyPair]) -> CudaNotification | None:
        """Pinned and device memory only: enqueue the batch on this transfer's own stream of
        the device and return an activated notification (woken by the dispatcher, like any
        stream's). Pageable memory (a synchronous copy) goes to the core's worker thread."""
        if not pairs:
            return None
        for s, d in pairs:
            if "pageable" in (
                self._locate(s.device, s.data_ptr)[0],
                self._locate(d.device, d.data_ptr)[0],
            ):
                return None
        stream = self._own_stream(self._batch_device(pairs))
        if stream is None:
            return None
        with stream.lock:
            self._enqueue(pairs, stream)
            mark = stream.create_notification()
            mark.activate()
        return mark

    def _own_stream(self, dev: CudaDevice) -> CudaStream | None:
        with self._lock:
            if self._closed:
                return None
            stream = self._own_streams.get(dev.ordinal)
            if stream is None:
                dispatcher = getattr(self._owner, "dispatcher", None)
                options = getattr(self._owner, "options", None)
                if dispatcher is None:
                    return None
                wake = getattr(options, "wake", "auto")
                stream = CudaStream(dev, dispatcher, wake=wake, owner=self._owner)
                self._own_streams[dev.ordinal] = stream
            return stream

    def _batch_device(self, pairs: Sequence[CopyPair]) -> CudaDevice:
        for s, d in pairs:
            for t in (d, s):
                if self._ours(t.device):
                    return self._devices[t.device.device_id]
        return next(iter(self._devices.values()))

    def _memcpy(self, d: Any, s: Any, cu: Any) -> None:
        drv = driver()
        src_loc = self._locate(s.device, s.data_ptr)
        dst_loc = self._locate(d.device, d.data_ptr)
        sdev, ddev = src_loc[1], dst_loc[1]
        if sdev is not None and ddev is not None and sdev is not ddev:
            self._enable_peer(sdev, ddev)
            check(
                drv.cuMemcpyPeerAsync(d.data_ptr, ddev.ctx, s.data_ptr, sdev.ctx, s.nbytes, cu),
                f"cuMemcpyPeerAsync(device {sdev.ordinal} -> {ddev.ordinal}, {s.nbytes} bytes)",
            )
        else:
            check(
                drv.cuMemcpyAsync(d.data_ptr, s.data_ptr, s.nbytes, cu),
                f"cuMemcpyAsync({src_loc[0]} -> {dst_loc[0]}, {s.nbytes} bytes)",
            )

    def _enable_peer(self, a: CudaDevice, b: CudaDevice) -> None:
        key = (a.ordinal, b.ordinal)
        if key in self._peer_done:
            return
        self._peer_done.add(key)
        drv = driver()
        for x, y in ((a, b), (b, a)):
            ok = drv.cuDeviceCanAccessPeer(x.cu_device, y.cu_device)
            if ok[0] == drv.CUresult.CUDA_SUCCESS and ok[1]:
                with ctx_current(x.ctx):
                    drv.cuCtxEnablePeerAccess(y.ctx, 0)  # already enabled: fine

    def _enqueue(self, pairs: Sequence[CopyPair], stream: CudaStream) -> None:
        dev = stream.device
        with stream.lock, ctx_current(dev.ctx):
            if stream.closed:
                raise DeviceError(f"{stream!r} is closed")
            stream.fence()
            staged, keep, direct = self._split(pairs)
            for s, d in direct:
                self._memcpy(d, s, stream.cu)
            stream.enqueued()
            if staged and not self._gate(stream, staged, keep):
                # No stream memory operations: CUDA's own (synchronous) pageable copies.
                for _, dst, src, n in staged:
                    copied = call_nogil("cuMemcpyAsync", dst, src, n, int(stream.cu))
                    check(copied, "cuMemcpyAsync (pageable)")

    def _gate(self, stream: CudaStream, pairs: list[StagedPair], keep: list[Tensor]) -> bool:
        if not self._stream_mem_ops:
            return False
        drv = driver()
        if stream.gate_addr is None:
            addr = stream.device.gate_slot()
            err = drv.cuMemsetD32Async(addr, 0, 1, stream.cu)[0]
            if err != drv.CUresult.CUDA_SUCCESS:
                stream.device.release_gate_slot(addr)
                raise DeviceError(f"cuMemsetD32Async on {stream!r} failed: {error_name(err)}")
            stream.gate_addr = addr
            stream.gate_value = 0
        before = stream.create_notification()
        before.activate()
        value = stream.gate_value + 1
        job = _GateJob(self._pageable, stream, pairs, keep, stream.gate_addr, value)
        self._pageable.track(job)
        # Arm before the wait is enqueued so the host function sits right after the event.
        before.add_done_callback(job.prerequisites_done)
        err = drv.cuStreamWaitValue32(
            stream.cu,
            stream.gate_addr,
            value & 0xFFFFFFFF,
            int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
        )[0]
        if err != drv.CUresult.CUDA_SUCCESS:
            self._pageable.untrack(job)
            if err != drv.CUresult.CUDA_ERROR_NOT_SUPPORTED:  # a broken context, say
                raise DeviceError(f"cuStreamWaitValue32 on {stream!r} failed: {error_name(err)}")
            # Unsupported here: the job never runs; fall back for good.
            self._stream_mem_ops = False
            return False
        stream.gate_value = value
        stream.gate_pending(value)
        stream.enqueued()
        job.gate_enqueued()
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams, self._own_streams = list(self._own_streams.values()), {}
        for stream in streams:  # queued work still runs; its waiters are polled to the end
            stream.close()
        self._pageable.close()


def _is_page_locked(ptr: int) -> bool:
    """True for host memory the driver knows (pinned by CUDA, CuPy or PyTorch): fully async."""
    if not ptr:
        return False
    drv = driver()
    try:
        err, kind = drv.cuPointerGetAttribute(
            drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr
        )
    except Exception:
        return False
    return bool(
        err == drv.CUresult.CUDA_SUCCESS and int(kind) == int(drv.CUmemorytype.CU_MEMORYTYPE_HOST)
    )
