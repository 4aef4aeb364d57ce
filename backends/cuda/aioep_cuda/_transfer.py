"""Copies between host, pinned and device memory with ``cuMemcpyAsync``.

Pinned and device memory: every pair of a batch is enqueued on the one stream
and the call returns at once. Pageable host memory is the exception: CUDA
copies it synchronously (H2D returns once the data is staged, D2H once it has
landed), so such a copy must not be issued on the event loop. Without a stream
a batch of pinned and device memory is enqueued on the transfer's own stream of the
device (:meth:`CudaDataTransfer.enqueue_unstreamed`: no thread hop, the dispatcher wakes
the awaiter); a batch with pageable memory runs on the core's worker thread. With a stream the
pageable pairs go through a *gate*:

1. on the caller's stream S: record an event (the work before the copy), then
   ``cuStreamWaitValue32(S, gate, k, GEQ)``: later work on S waits on the device;
2. when that event completes (the dispatcher wakes us, no thread blocks for it)
   the factory's one pageable-copy thread issues the copies on its side stream
   and then ``cuStreamWriteValue32(side, gate, k)``, which releases S on the
   device once the data has moved.

The loop never blocks, stream order is kept, and no thread ever waits on a
stream that could itself be waiting for that thread (no deadlock across
streams). Where stream memory operations are unsupported, the pageable pairs
are copied on the calling thread (documented fallback).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from aioep import DeviceError, DeviceType, MemoryDevice, MemoryType
from aioep.abc import CopyPair, DataTransfer, StreamImpl

from ._device import NVIDIA_VENDOR_ID, CudaDevice
from ._driver import call_nogil, check, ctx_current, driver, error_name
from ._stream import CudaNotification, CudaStream

__all__ = ["CudaDataTransfer", "PageableCopier"]

_Loc = tuple[str, CudaDevice | None]  # ("device", dev) | ("pinned", None) | ("pageable", None)


class PageableCopier:
    """The factory's single thread that issues stream-gated pageable host copies."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: collections.deque[tuple[CudaStream, list[tuple[int, int, int]], int, int]] = (
            collections.deque()
        )
        self._thread: threading.Thread | None = None
        self._closed = False
        self._waiting: set[_GateJob] = set()

    def submit(
        self, stream: CudaStream, jobs: list[tuple[int, int, int]], addr: int, value: int
    ) -> None:
        """Queue a ready job (its prerequisites on ``stream`` are complete)."""
        with self._cond:
            if self._closed:
                # Never leave the stream gated: release it without copying.
                stream.gate_errors[value] = DeviceError("the CUDA backend closed before a copy ran")
                self._release(stream, addr, value)
                return
            self._jobs.append((stream, jobs, addr, value))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="aioep-cuda-pageable", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def track(self, job: _GateJob) -> None:
        """Note a gate job whose prerequisites have not completed yet."""
        with self._cond:
            self._waiting.add(job)

    def untrack(self, job: _GateJob) -> None:
        """The job was submitted (or abandoned)."""
        with self._cond:
            self._waiting.discard(job)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    if self._closed:
                        return
                    self._cond.wait()
                stream, jobs, addr, value = self._jobs.popleft()
            self._copy(stream, jobs, addr, value)

    def _copy(
        self, stream: CudaStream, jobs: list[tuple[int, int, int]], addr: int, value: int
    ) -> None:
        dev = stream.device
        try:
            side = int(dev.side_stream())
            with ctx_current(dev.ctx):
                for dst, src, n in jobs:
                    check(
                        call_nogil("cuMemcpyAsync", dst, src, n, side), "cuMemcpyAsync (pageable)"
                    )
        except BaseException as exc:
            stream.gate_errors[value] = exc.with_traceback(None)
        finally:
            self._release(stream, addr, value)

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
        """Finish queued jobs, then stop the thread; idempotent. A gate whose prerequisites
        have not completed yet (a stream still held on the device, or failed) is opened
        without its copy (its futures fail with a :class:`DeviceError`), so that no stream of
        the context waits for a copy that will never run."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
            waiting, self._waiting = list(self._waiting), set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        for job in sorted(waiting, key=lambda j: j.value):
            job.abandon()


class _GateJob:
    """Runs a gated pageable copy once both its prerequisites completed and its gate is set."""

    __slots__ = ("_copier", "_done", "_fired", "_lock", "_ready", "addr", "jobs", "stream", "value")

    def __init__(
        self,
        copier: PageableCopier,
        stream: CudaStream,
        jobs: list[tuple[int, int, int]],
        addr: int,
        value: int,
    ) -> None:
        self._copier = copier
        self._lock = threading.Lock()
        self._fired = self._ready = self._done = False
        self.stream, self.jobs, self.addr, self.value = stream, jobs, addr, value

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
            self._copier.submit(self.stream, self.jobs, self.addr, self.value)

    def gate_enqueued(self) -> None:
        with self._lock:
            self._ready = True
            go = self._go()
        if go:
            self._copier.untrack(self)
            self._copier.submit(self.stream, self.jobs, self.addr, self.value)

    def abandon(self) -> None:
        """At close: open the gate without copying (the copy's futures fail)."""
        with self._lock:
            if self._done or not self._ready:
                return
            self._done = True
        self.stream.gate_errors[self.value] = DeviceError(
            "the CUDA backend closed before a pageable copy's stream reached it"
        )
        PageableCopier._release(self.stream, self.addr, self.value)


class CudaDataTransfer(DataTransfer):
    """H2D, D2H and D2D (same device and peer) copies, pinned or pageable host memory."""

    max_inline_bytes = 0  # never copy on the event loop

    def __init__(self, devices: Mapping[int, CudaDevice], owner: Any) -> None:
        self._devices = dict(devices)
        self._owner = owner
        self._pageable = PageableCopier()
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
        # Synchronous (the core runs this on a worker thread): this thread's own stream.
        dev = self._batch_device(pairs)
        cu, event, seen = dev.copy_stream()
        drv = driver()
        seen[0] = dev.shared.fence(cu, seen[0])
        with ctx_current(dev.ctx):
            for s, d in pairs:
                if s.nbytes:
                    self._memcpy(d, s, cu)
            check(drv.cuEventRecord(event, cu), "cuEventRecord")
            # A blocking-sync event: the thread sleeps in the driver, it does not spin.
            check(call_nogil("cuEventSynchronize", int(event)), "cuEventSynchronize")

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
        elif "pageable" in (src_loc[0], dst_loc[0]):
            # Synchronous for the host: without the GIL (see call_nogil).
            check(
                call_nogil("cuMemcpyAsync", d.data_ptr, s.data_ptr, s.nbytes, int(cu)),
                f"cuMemcpyAsync({src_loc[0]} -> {dst_loc[0]}, {s.nbytes} bytes)",
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
        pageable: list[tuple[int, int, int]] = []
        with stream.lock, ctx_current(dev.ctx):
            if stream.closed:
                raise DeviceError(f"{stream!r} is closed")
            stream.fence()
            for s, d in pairs:
                if not s.nbytes:
                    continue
                if (
                    self._locate(s.device, s.data_ptr)[0] == "pageable"
                    or self._locate(d.device, d.data_ptr)[0] == "pageable"
                ):
                    pageable.append((d.data_ptr, s.data_ptr, s.nbytes))
                else:
                    self._memcpy(d, s, stream.cu)
            stream.enqueued()
            if pageable and not self._gate(stream, pageable):
                # No stream memory operations: CUDA's own (synchronous) pageable copies.
                for dst, src, n in pageable:
                    copied = call_nogil("cuMemcpyAsync", dst, src, n, int(stream.cu))
                    check(copied, "cuMemcpyAsync (pageable)")

    def _gate(self, stream: CudaStream, jobs: list[tuple[int, int, int]]) -> bool:
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
        job = _GateJob(self._pageable, stream, jobs, stream.gate_addr, value)
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
