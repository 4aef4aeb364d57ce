"""Per-GPU state: the process-wide `SharedDevice` (retained primary context, event
pool, caching memory pools, helper stream, gate words) and a factory's `CudaDevice`."""

from __future__ import annotations

import threading
from typing import Any

from aioep import DeviceError, DeviceType, HardwareDevice, MemoryDevice, MemoryInfo, MemoryType

from ._driver import call_nogil, check, ctx_current, driver, error_name
from ._pool import CachingPool, size_class
from ._probe import GpuFacts

__all__ = [
    "NVIDIA_VENDOR_ID",
    "CudaDevice",
    "EventPool",
    "SharedDevice",
    "acquire_shared",
    "leave_shared",
    "release_idle_devices",
]

NVIDIA_VENDOR_ID = 0x10DE
_GATE_SLOTS = 1024  # 4-byte gate words per device (one per stream that copies pageable memory)


class EventPool:
    """Reusable ``CUevent`` objects created with ``CU_EVENT_DISABLE_TIMING``.

    Creating an event is a driver call with a lock inside; a notification is made
    for every ``stream.record()``, so events are recycled (up to ``keep`` idle). The pool
    knows every event it made: `close` (just before its context is released) destroys
    them all, idle or still held, and marks the pool `dead`; an event given back after
    that is forgotten, never destroyed again, and a holder that asks about it learns that the
    device closed (no driver call touches a handle of a released context).
    """

    def __init__(self, device: SharedDevice, keep: int = 1024) -> None:
        self._device = device
        self._keep = keep
        self._free: list[Any] = []
        self._all: dict[int, Any] = {}
        self._lock = threading.RLock()
        self.dead = False
        self.created = 0

    def take(self) -> Any:
        """An idle event, or a new one."""
        with self._lock:
            if self.dead:
                raise DeviceError(f"CUDA device {self._device.ordinal} is closed")
            if self._free:
                return self._free.pop()
        drv = driver()
        with ctx_current(self._device.ctx):
            event = check(
                drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate"
            )
        with self._lock:
            self._all[int(event)] = event
        self.created += 1
        return event

    def give(self, event: Any) -> None:
        """Return an event; a later ``cuEventRecord`` re-marks it (waits already enqueued keep
        the state they captured, so reuse is safe)."""
        with self._lock:
            if self.dead:
                return
            if len(self._free) < self._keep:
                self._free.append(event)
                return
            self._all.pop(int(event), None)
        try:
            with ctx_current(self._device.ctx):
                driver().cuEventDestroy(event)
        except Exception:  # finalizers at interpreter exit: nothing can be raised
            pass

    def close(self) -> None:
        """Destroy every event the pool made (its context is about to be released)."""
        with self._lock:
            self.dead = True
            events = list(self._all.values())
            self._all.clear()
            self._free.clear()
        drv = driver()
        try:
            with ctx_current(self._device.ctx):
                for event in events:
                    drv.cuEventDestroy(event)
        except Exception:  # a broken context: the events go with it
            pass


def _on_event_loop() -> bool:
    """True on a thread that runs an asyncio or trio event loop (nothing may wait there)."""
    import asyncio
    import sys

    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        # current_trio_token() raises outside a run on every trio version (in_trio_run() is
        # only in trio >= 0.27; the lowest declared version is older).
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            return False
        return True
    return False


_registry: dict[int, SharedDevice] = {}
# The backend's locks are re-entrant: memory and events come back from finalizers, which a
# garbage collection may run on a thread that already holds the lock they need.
_registry_lock = threading.RLock()


class SharedDevice:
    """What every environment of the process shares on one GPU: the retained primary
    context and everything that must not outlive it.

    The primary context is one per device and process (CuPy and PyTorch use it too). It is
    retained while any environment uses the device *or* anything made in it is still held:
    an event of the pool, a pinned block, a device buffer. It is released only by the
    closing of the last environment on the device, off the event loop, when nothing is held
    any more: then every stream is idle (``cuCtxSynchronize``), the pools' memory goes back
    to the driver (the synchronising frees), the helper stream and idle events are
    destroyed, and the context is released. Whatever is given back later finds the context
    alive, and the next environment reuses the pools.
    """

    def __init__(self, ordinal: int, cu_device: Any) -> None:
        drv = driver()
        self.ordinal = ordinal
        self.cu_device = cu_device
        self.ctx = check(drv.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain")
        self.users = 0
        self.lock = threading.RLock()
        self.events = EventPool(self)
        self.pinned = CachingPool(self, "pinned", self._host_alloc, self._host_free)
        """Page-locked host memory (``cuMemHostAlloc``), reused by size class."""
        self.device_cache = CachingPool(
            self, "device memory", self._dev_alloc, self._dev_free, round=_device_round
        )
        """``cuMemAlloc`` memory of ``allocator="sync"`` (its ``cuMemFree`` synchronises)."""
        self.held = 0
        """Device buffers (stream-ordered) alive in this context."""
        self._helper: Any = None
        self._ready: Any = None  # recorded on the helper stream after each allocation on it
        self.alloc_gen = 0  # bumped when an allocation on the helper may not be done yet
        self._gate_bases: list[int] = []
        self.gate_free: list[int] = []
        self._tails: list[Any] = []  # events recorded last on streams destroyed so far
        self._unmarked: list[Any] = []  # streams closed whose last work could not be marked
        self.released = False

    # -- memory functions of the pools -------------------------------------------------------
    def _host_alloc(self, size: int) -> int:
        drv = driver()
        flags = drv.CU_MEMHOSTALLOC_PORTABLE | drv.CU_MEMHOSTALLOC_DEVICEMAP
        with ctx_current(self.ctx):
            err, ptr = drv.cuMemHostAlloc(size, flags)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise DeviceError(f"cuMemHostAlloc of {size} bytes failed: {error_name(err)}")
        return int(ptr)

    def _host_free(self, ptr: int) -> None:
        with ctx_current(self.ctx):
            call_nogil("cuMemFreeHost", ptr)

    def _dev_alloc(self, size: int) -> int:
        drv = driver()
        with ctx_current(self.ctx):
            err, ptr = drv.cuMemAlloc(size)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise DeviceError(f"cuMemAlloc of {size} bytes failed: {error_name(err)}")
        return int(ptr)

    def _dev_free(self, ptr: int) -> None:
        with ctx_current(self.ctx):
            call_nogil("cuMemFree_v2", ptr)

    # -- the helper stream: allocations and frees made without a stream -----------------------
    def helper_stream(self) -> Any:
        """The non-blocking stream for allocations and frees made without a stream (lives as
        long as the context: a buffer freed after its environment closed still uses it)."""
        with self.lock:
            if self._helper is None:
                drv = driver()
                with ctx_current(self.ctx):
                    self._helper = check(
                        drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING),
                        "cuStreamCreate",
                    )
                    self._ready = check(
                        drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                        "cuEventCreate",
                    )
            return self._helper

    def alloc_on_helper(self, nbytes: int) -> tuple[Any, Any]:
        """``cuMemAllocAsync`` on the helper stream: (CUresult, ptr). Nothing waits: if the
        allocation is not done at once, `alloc_gen` moves on and every stream waits on
        the device for the helper stream before it next uses memory (`fence`)."""
        drv = driver()
        helper = self.helper_stream()
        with self.lock, ctx_current(self.ctx):
            err, ptr = drv.cuMemAllocAsync(nbytes, helper)
            if err != drv.CUresult.CUDA_SUCCESS:
                return err, ptr
            check(drv.cuEventRecord(self._ready, helper), "cuEventRecord(helper)")
            if drv.cuEventQuery(self._ready)[0] != drv.CUresult.CUDA_SUCCESS:
                self.alloc_gen += 1
        return err, ptr

    def fence(self, cu: Any, seen: int) -> int:
        """Make stream ``cu`` wait (on the device) for the helper stream's allocations after
        generation ``seen``; return the generation it is now past. Never blocks the host."""
        if seen >= self.alloc_gen:
            return seen
        drv = driver()
        with self.lock, ctx_current(self.ctx):
            gen = self.alloc_gen
            check(drv.cuStreamWaitEvent(cu, self._ready, 0), "cuStreamWaitEvent(allocations)")
        return gen

    # -- gate words (pageable copies, see _transfer) -----------------------------------------
    def gate_slot(self) -> int:
        """A device address of a 4-byte gate word (a new page of them when all are taken).

        The words are not cleared here: a synchronous ``cuMemsetD32`` runs on the legacy
        default stream, which waits for every blocking stream of the context (another
        library's work), on the caller's thread, the event loop. Each stream clears its
        word in its own order before its first wait (``cuMemsetD32Async``).
        """
        with self.lock:
            if not self.gate_free:
                base = self._dev_alloc(4 * _GATE_SLOTS)
                self._gate_bases.append(base)
                self.gate_free = [base + 4 * i for i in range(_GATE_SLOTS)]
            return self.gate_free.pop()

    def release_gate_slot(self, addr: int) -> None:
        """Give a gate word back (its stream closed and is past every wait on it)."""
        with self.lock:
            self.gate_free.append(addr)

    # -- lifetime -----------------------------------------------------------------------------
    def destroy_stream(self, cu: Any) -> None:
        """``cuStreamDestroy`` after recording a tail event on it: the stream's queued work
        still runs, and `release` waits for that event (not for the whole context).

        If no tail can be recorded (a broken context: every call fails), the stream is kept
        and destroyed by `release` after ``cuStreamSynchronize``: a destroyed stream
        could not be waited for, and its queued work (a wait on a gate word that will never
        be written, say) may not have drained yet when the synchronising frees come."""
        drv = driver()
        with ctx_current(self.ctx):
            err, event = drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            if err == drv.CUresult.CUDA_SUCCESS:
                if drv.cuEventRecord(event, cu)[0] == drv.CUresult.CUDA_SUCCESS:
                    with self.lock:
                        self._tails.append(event)
                    drv.cuStreamDestroy(cu)
                    return
                drv.cuEventDestroy(event)
        with self.lock:
            self._unmarked.append(cu)

    def busy(self) -> bool:
        """Memory made in the context still held by someone (pinned blocks, buffers)."""
        return bool(self.pinned.in_use_bytes or self.device_cache.in_use_bytes or self.held)

    def maybe_release(self) -> None:
        """Called when memory comes back: the last piece after the last environment on the
        device closed releases the shared state, on a thread of its own (this may be a
        garbage collection on the event loop, and the release waits for the device)."""
        if not self.users:
            _release_if_idle(self, inline=False)

    def release(self) -> None:
        """Wait for this process's work on the device, give every cached resource back,
        release the context.

        Off the event loop, with nothing held. The wait is for the work of the streams the
        backend made (the tail event of each destroyed stream, the helper stream's last
        work), not a context synchronisation; the frees that follow then find the backend's
        streams idle. In a broken context (a sticky error) events cannot be recorded: the
        streams closed then were kept and are waited for here with ``cuStreamSynchronize``.
        """
        drv = driver()
        self.released = True
        try:
            with ctx_current(self.ctx):
                if self._helper is not None:
                    if drv.cuEventRecord(self._ready, self._helper)[0] == drv.CUresult.CUDA_SUCCESS:
                        call_nogil("cuEventSynchronize", int(self._ready))
                    else:  # a broken context: wait for the helper stream itself
                        call_nogil("cuStreamSynchronize", int(self._helper))
                for event in self._tails:
                    call_nogil("cuEventSynchronize", int(event))
                    drv.cuEventDestroy(event)
                for cu in self._unmarked:
                    call_nogil("cuStreamSynchronize", int(cu))
                    drv.cuStreamDestroy(cu)
                self.pinned.release_all()
                self.device_cache.release_all()
                for base in self._gate_bases:
                    call_nogil("cuMemFree_v2", base)
                if self._helper is not None:
                    drv.cuEventDestroy(self._ready)
                    drv.cuStreamDestroy(self._helper)
            self.events.close()
        finally:
            self._tails.clear()
            self._unmarked.clear()
            self._gate_bases.clear()
            self.gate_free.clear()
            self._helper = self._ready = None
            drv.cuDevicePrimaryCtxRelease(self.cu_device)


def _device_round(nbytes: int) -> int:
    return size_class(nbytes, coarse_above=1 << 20, coarse=1 << 20)


def acquire_shared(ordinal: int, cu_device: Any) -> SharedDevice:
    """The process's `SharedDevice` of GPU ``ordinal`` (made on first use); one more user."""
    with _registry_lock:
        shared = _registry.get(ordinal)
        if shared is None:
            shared = SharedDevice(ordinal, cu_device)
            _registry[ordinal] = shared
        shared.users += 1
        return shared


def leave_shared(shared: SharedDevice) -> None:
    """One user less. The last one releases the shared state once nothing is held any more:
    here when this thread may wait (the environment closes off the event loop), else on a
    thread of its own; memory still held releases it when it comes back."""
    with _registry_lock:
        shared.users -= 1
    _release_if_idle(shared, inline=not _on_event_loop())


def _release_if_idle(shared: SharedDevice, *, inline: bool) -> None:
    with _registry_lock:
        if shared.users or shared.busy() or _registry.get(shared.ordinal) is not shared:
            return
        del _registry[shared.ordinal]
    if inline:
        shared.release()
    else:
        threading.Thread(target=shared.release, name="aioep-cuda-release", daemon=True).start()


def release_idle_devices() -> int:
    """Release the shared state of every GPU no environment uses and nothing holds (for
    programs that dropped their last buffers after closing); off the event loop. Returns
    how many were released."""
    with _registry_lock:
        idle = [s for s in _registry.values() if not s.users and not s.busy()]
        for s in idle:
            del _registry[s.ordinal]
    for s in idle:
        s.release()
    return len(idle)


class CudaDevice:
    """One GPU as one factory sees it: ordinal, ``CUdevice``, memory infos, its own helper
    streams; the context and pools are the process's `SharedDevice`."""

    def __init__(self, ordinal: int, *, pinned_pool_limit: int = -1) -> None:
        drv = driver()
        self.ordinal = ordinal
        self.cu_device = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        self.facts = GpuFacts.read(drv, ordinal)
        self.name = self.facts.name
        self.uuid = self.facts.uuid
        self.pci_bus_id = self.facts.pci_bus_id
        self.compute_capability = self.facts.compute_capability
        self.total_memory = self.facts.total_memory
        self.memory_pools = self.facts.memory_pools
        self.shared = acquire_shared(ordinal, self.cu_device)
        self.shared.pinned.limit = pinned_pool_limit  # per process: the last opened sets it
        self.ctx = self.shared.ctx
        self.events = self.shared.events
        self._released = False
        self.default_info = MemoryInfo(
            "Cuda", MemoryDevice(DeviceType.GPU, MemoryType.DEFAULT, NVIDIA_VENDOR_ID, ordinal), 256
        )
        self.pinned_info = MemoryInfo(
            "CudaPinned",
            MemoryDevice(DeviceType.GPU, MemoryType.HOST_ACCESSIBLE, NVIDIA_VENDOR_ID, ordinal),
            256,
        )
        self._lock = threading.RLock()
        self._side: Any = None  # the pageable-copy worker's stream
        self._local = threading.local()
        self._copy_streams: list[tuple[Any, Any, list[int]]] = []

    @property
    def pinned(self) -> CachingPool:
        """The device's pinned host memory pool (shared by the process's environments)."""
        return self.shared.pinned

    @property
    def hardware(self) -> HardwareDevice:
        """This GPU as an `aioep.HardwareDevice` (name, UUID, PCI bus id in metadata)."""
        return HardwareDevice(
            DeviceType.GPU,
            NVIDIA_VENDOR_ID,
            self.ordinal,
            "NVIDIA",
            self.facts.metadata(),
        )

    def new_stream(self) -> Any:
        """A new non-blocking ``CUstream`` on this device."""
        drv = driver()
        with ctx_current(self.ctx):
            return check(
                drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"
            )

    def helper_stream(self) -> Any:
        """The device's helper stream (allocations and frees made without a stream)."""
        return self.shared.helper_stream()

    def side_stream(self) -> Any:
        """The stream the pageable-copy worker uses on this device."""
        with self._lock:
            if self._side is None:
                self._side = self.new_stream()
            return self._side

    def copy_stream(self) -> tuple[Any, Any, list[int]]:
        """This thread's (stream, blocking-sync event, [allocation generation it waited for])
        for copies made without a stream."""
        pair = getattr(self._local, "pair", None)
        if pair is None:
            drv = driver()
            stream = self.new_stream()
            flags = (
                drv.CUevent_flags.CU_EVENT_DISABLE_TIMING | drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC
            )
            with ctx_current(self.ctx):
                event = check(drv.cuEventCreate(flags), "cuEventCreate")
            pair = (stream, event, [0])
            self._local.pair = pair
            with self._lock:
                self._copy_streams.append(pair)
        return pair

    def gate_slot(self) -> int:
        """A device address of a 4-byte gate word (see `SharedDevice.gate_slot`)."""
        return self.shared.gate_slot()

    def release_gate_slot(self, addr: int) -> None:
        """Give a gate word back (its stream closed and is past every wait on it)."""
        self.shared.release_gate_slot(addr)

    def gate_slot_is_free(self, addr: int) -> bool:
        """True if gate word ``addr`` is back with the device (diagnostics and tests)."""
        with self.shared.lock:
            return addr in self.shared.gate_free

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes from ``cuMemGetInfo``; (-1, total) if the query fails."""
        drv = driver()
        try:
            with ctx_current(self.ctx):
                free, total = check(drv.cuMemGetInfo(), "cuMemGetInfo")
            return int(free), int(total)
        except DeviceError:
            return -1, self.total_memory

    def close(self) -> None:
        """Destroy this factory's streams (their queued work still runs), then leave the
        shared state; idempotent. Nothing here waits for the device except the shared
        state's final release (off the loop, see `leave_shared`)."""
        if self._released:
            return
        self._released = True
        drv = driver()
        try:
            if self._side is not None:
                self.shared.destroy_stream(self._side)
            for stream, event, _ in self._copy_streams:
                with ctx_current(self.ctx):
                    drv.cuEventDestroy(event)
                self.shared.destroy_stream(stream)
        finally:
            self._side = None
            self._copy_streams.clear()
            leave_shared(self.shared)

    def __repr__(self) -> str:
        return f"<CudaDevice {self.ordinal} {self.name!r}>"
