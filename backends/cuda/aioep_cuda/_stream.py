"""CUDA streams (non-blocking ``CUstream``) and notifications (pooled ``CUevent``)."""

from __future__ import annotations

import copy
import functools
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aioep import ClosedError, DeviceError, NotImplementedByEp
from aioep.abc import NotificationImpl, StreamImpl, ThreadStream

from ._driver import ctx_current, driver, error_name, launch_host_func

if TYPE_CHECKING:
    from ._device import CudaDevice
    from ._wake import Dispatcher

__all__ = ["CudaNotification", "CudaStream"]

_keys = itertools.count(1)  # dispatcher FIFO keys: never reused, unlike CUstream values


class CudaStream(StreamImpl):
    """A non-blocking ``CUstream`` on one device; ``handle`` is its integer value.

    ``seq`` counts everything enqueued (copies, event records, waits): a
    notification whose host function would land after later work is polled
    instead, so it is never woken late.

    `close` may come while work is still queued (the driver runs it after
    ``cuStreamDestroy``): waiters armed on the stream are polled to the end, and
    the stream's pageable-copy gate word goes back to the device only once the
    stream is past every wait on it (`gate_released` is set then).
    """

    def __init__(
        self, device: CudaDevice, dispatcher: Dispatcher, *, wake: str = "auto", owner: Any = None
    ) -> None:
        self.device = device
        self.dispatcher = dispatcher
        self.wake = wake
        self.owner = owner
        self.cu = device.new_stream()
        self._handle = int(self.cu)
        self.key = next(_keys)
        self.lock = threading.RLock()
        self.seq = 0
        self.closed = False
        self.hostfn_failures = 0
        # Gate word for pageable copies (see _transfer): value counter and errors by value.
        self.gate_addr: int | None = None
        self.gate_value = 0
        self.gate_mark = 0
        self.gate_errors: dict[int, BaseException] = {}
        # Gate values whose staged copy may still make driver calls (see gate_pending).
        self._unsettled: set[int] = set()
        self._settle_waiters: list[tuple[int, Callable[[], None]]] = []
        self._settle_lock = threading.Lock()
        self.gate_released = threading.Event()
        """Set once the gate word (if any) is back with the device after `close`."""
        self.alloc_seen = 0  # the helper stream's allocation generation this stream waited for

    def fence(self) -> None:
        """Before using memory: wait on the device for allocations made without a stream
        (never blocks the host; see `SharedDevice.fence`). Call with `lock` held."""
        self.alloc_seen = self.device.shared.fence(self.cu, self.alloc_seen)

    def mark(self) -> Any | None:
        """A pooled event recorded on this stream now (the caller gives it back to
        ``device.events``), or None once the stream is closed or the record failed."""
        drv = driver()
        with self.lock:
            if self.closed:
                return None
            try:
                event = self.device.events.take()
            except DeviceError:
                return None
            with ctx_current(self.device.ctx):
                err = drv.cuEventRecord(event, self.cu)[0]
            if err != drv.CUresult.CUDA_SUCCESS:
                self.device.events.give(event)
                return None
            self.enqueued()
            return event

    @property
    def handle(self) -> int:
        """The ``CUstream`` as an int. Before handing it out, the stream is made to wait (on
        the device) for allocations made without a stream so far, so that work another library
        enqueues on it sees them (as the backend's own copies do)."""
        if self.alloc_seen < self.device.shared.alloc_gen and not self.closed:
            with self.lock:
                if not self.closed:
                    try:
                        self.fence()
                    except DeviceError:  # a broken context: the work will fail anyway
                        pass
        return self._handle

    def create_notification(self) -> CudaNotification:
        return CudaNotification(self)

    def enqueued(self) -> None:
        """Note that work was enqueued (called with `lock` held or from the loop)."""
        self.seq += 1

    def gate_errors_between(self, lo: int, hi: int) -> BaseException | None:
        """The first pageable-copy failure with a gate value in ``(lo, hi]``, as a new
        exception: the one kept here is never raised (a raise would attach the awaiting
        frames, and this long-lived stream would keep their tensors alive)."""
        if not self.gate_errors:
            return None
        for value in sorted(self.gate_errors):
            if lo < value <= hi:
                kept = self.gate_errors[value]
                return (
                    DeviceError(str(kept))
                    if isinstance(kept, DeviceError)
                    else DeviceError(f"{type(kept).__name__}: {kept}")
                )
        return None

    def gate_pending(self, value: int) -> None:
        """Gate ``value``'s staged copy is under way: a notification recorded after its wait
        completes only once `gate_settled` says the copy makes no more driver calls.

        On success that is already so when the device passes the gate; but after a sticky
        error every later event of the context reports the error at once, while the stager
        may still be working on the copy (enqueueing, recording its release mark). Without
        this the caller would see the copy fail, drop its device memory, or close its device
        (its event pool), while a stager thread still used them."""
        with self._settle_lock:
            self._unsettled.add(value)

    def gate_settled(self, value: int) -> None:
        """Gate ``value``'s staged copy is over: it makes no more driver calls (it ran, failed
        or was abandoned, and its gate word is written or given up)."""
        with self._settle_lock:
            self._unsettled.discard(value)
            low = min(self._unsettled, default=None)
            if low is None:
                ready, self._settle_waiters = self._settle_waiters, []
            else:
                ready = [w for w in self._settle_waiters if w[0] < low]
                self._settle_waiters = [w for w in self._settle_waiters if w[0] >= low]
        for _, fn in ready:
            fn()

    def when_gates_settled(self, upto: int, fn: Callable[[], None]) -> bool:
        """True if every gate value up to ``upto`` is settled; else False, and ``fn()`` runs
        (on the thread that settles the last of them) once they are."""
        with self._settle_lock:
            if not any(v <= upto for v in self._unsettled):
                return True
            self._settle_waiters.append((upto, fn))
            return False

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            end: CudaNotification | None = None
            gate = self.gate_addr
            if gate is not None:
                # The last gate value may not be written yet (the pageable-copy thread
                # writes it once the copy is done), and the stream may still wait for it.
                # Handing the word to another stream now would let its reset strand this
                # stream's wait, or this stream's late write open the other's gate early.
                try:
                    end = CudaNotification(self)
                    end.activate()
                except DeviceError:  # a broken context: nothing will wait on the word again
                    end = None
            self.closed = True
            self.device.shared.destroy_stream(self.cu)
        self.dispatcher.retire(self.key)
        if gate is None:
            self.gate_released.set()
            return

        def release() -> None:
            self.gate_addr = None
            self.device.release_gate_slot(gate)
            self.gate_released.set()

        if end is None:
            release()
            return
        try:
            end.add_done_callback(release)
        except ClosedError:  # the factory is closing: its devices go too
            release()

    def __repr__(self) -> str:
        return f"<CudaStream {self._handle:#x} on {self.device!r}>"


class CudaNotification(NotificationImpl):
    """A pooled ``CUevent`` (timing disabled) recorded on a `CudaStream`.

    Completion reaches `add_done_callback` callbacks through the
    factory's dispatcher: a ``sem_post`` host function enqueued right after the
    event record, or polling with backoff when that is not possible.
    """

    __slots__ = (
        "_armed",
        "_callbacks",
        "_deferred",
        "_done",
        "_error",
        "_event",
        "_gates",
        "_gen",
        "_lock",
        "_no_event",
        "_seq",
        "_stream",
        "_unrecorded",
    )

    def __init__(self, stream: CudaStream) -> None:
        self._stream = stream
        self._no_event: DeviceError | None = None
        try:
            self._event = stream.device.events.take()
        except DeviceError as exc:  # a broken context (cuEventCreate) or a closed device
            self._event, self._no_event = None, exc
        else:
            weakref.finalize(self, stream.device.events.give, self._event)
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._gen = 0  # activation count; 0: never recorded (complete, like an unrecorded event)
        self._done = 0  # the generation known complete
        self._deferred = 0  # the generation waiting for staged copies before it (gate_pending)
        self._armed = 0  # the generation a waiter is registered for
        self._error: BaseException | None = None
        self._unrecorded: DeviceError | None = None  # why the current generation has no record
        self._seq = 0
        self._gates = (0, 0)

    @property
    def event(self) -> Any:
        """The ``CUevent`` (valid while this notification is alive); None if none could be
        made (see `recorded_event`)."""
        return self._event

    def recorded_event(self) -> Any:
        """The ``CUevent`` as recorded by the last `activate`, for a
        ``cuStreamWaitEvent``; `DeviceError` if that record failed."""
        with self._lock:
            failed = self._unrecorded
        if failed is not None:
            raise DeviceError(str(failed))
        return self._event

    @property
    def stream(self) -> CudaStream:
        """The stream this notification marks."""
        return self._stream

    def activate(self) -> None:
        """Record the event at the stream's tail. A closed stream raises
        `DeviceError`; a record the driver refuses (a broken context) does not: the
        notification completes with that error instead, once the staged copies enqueued
        before it make no more driver calls (see `CudaStream.gate_pending`). The copy
        it marks was handed over already, so its caller must keep the memory until then."""
        stream = self._stream
        drv = driver()
        failed: DeviceError | None = None
        with stream.lock:
            if stream.closed:
                raise DeviceError(f"{stream!r} is closed")
            if self._event is None:
                failed = DeviceError(f"no CUDA event to mark {stream!r}: {self._no_event}")
            else:
                with ctx_current(stream.device.ctx):
                    err = drv.cuEventRecord(self._event, stream.cu)[0]
                if err != drv.CUresult.CUDA_SUCCESS:
                    failed = DeviceError(f"cuEventRecord on {stream!r} failed: {error_name(err)}")
            if failed is None:
                stream.enqueued()
            seq = stream.seq
            gates = (stream.gate_mark, stream.gate_value)
            stream.gate_mark = stream.gate_value
        with self._lock:
            self._gen += 1
            self._seq = seq
            self._gates = gates
            self._error = None
            self._unrecorded = failed
            gen = self._gen
            rearm = bool(self._callbacks) and failed is None
            if rearm or failed is not None:
                self._armed = gen  # a failed record is never armed: it completes below
        if failed is not None:
            self._finish(gen, failed)
        elif rearm:
            self._arm(gen)

    def wait_on_device(self, stream: StreamImpl) -> None:
        if self._stream.device.events.dead:
            raise DeviceError(f"{self._stream!r}: the CUDA device was closed")
        if isinstance(stream, CudaStream):
            drv = driver()
            event = self.recorded_event()
            with stream.lock, ctx_current(stream.device.ctx):
                err = drv.cuStreamWaitEvent(stream.cu, event, 0)[0]
                if err != drv.CUresult.CUDA_SUCCESS:
                    raise DeviceError(
                        f"cuStreamWaitEvent({stream!r}, event of {self._stream!r}) failed: "
                        f"{error_name(err)}"
                    )
                stream.enqueued()
        elif isinstance(stream, ThreadStream):
            stream.enqueue_wait(self)
        else:
            raise NotImplementedByEp(
                f"a CUDA event cannot order a {type(stream).__name__} on the device; await the "
                "notification first"
            )

    # -- completion ------------------------------------------------------------------------
    def _query_event(self, *, retried: bool = False) -> tuple[bool, BaseException | None]:
        with self._lock:
            unrecorded = self._unrecorded
        if unrecorded is not None:
            return True, unrecorded
        if self._stream.device.events.dead:
            return True, DeviceError(f"{self._stream!r}: the CUDA device was closed")
        drv = driver()
        err = drv.cuEventQuery(self._event)[0]
        if err == drv.CUresult.CUDA_SUCCESS:
            return True, None
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False, None
        if err == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT and not retried:
            # A thread without a context: retry once with the device's context (a context
            # that is itself invalid must end as an error, not recurse without end).
            with ctx_current(self._stream.device.ctx):
                return self._query_event(retried=True)
        return True, DeviceError(
            f"work on {self._stream!r} before this event failed: {error_name(err)}"
        )

    def _finish(self, gen: int, error: BaseException | None) -> None:
        with self._lock:
            if gen != self._gen or self._done == gen:
                return
            upto = self._gates[1]
            if self._deferred == gen:  # already waiting for the staged copies below
                return
            self._deferred = gen
        # A staged copy before this point still at work (after a sticky error the event
        # reports it before the copy is over): complete once it is (see gate_pending).
        if not self._stream.when_gates_settled(upto, functools.partial(self._settled, gen, error)):
            return
        self._settled(gen, error)

    def _settled(self, gen: int, error: BaseException | None) -> None:
        with self._lock:
            if gen != self._gen or self._done == gen:
                return
            if error is None:
                error = self._stream.gate_errors_between(*self._gates)
            self._done = gen
            self._error = error
            callbacks, self._callbacks = self._callbacks, []
        # Each callback is dropped before the next runs: what a callback holds (a copy's
        # tensors) must not stay referenced from this thread once the awaiting task resumed.
        callbacks.reverse()
        while callbacks:
            callbacks.pop()()

    def _check(self, gen: int) -> bool:
        """The dispatcher's waiter: True once generation ``gen`` is complete (or stale)."""
        with self._lock:
            if gen != self._gen or self._done == gen:
                return True
        done, error = self._query_event()
        if done:
            self._finish(gen, error)
        return done

    def query(self) -> bool:
        with self._lock:
            if self._gen == 0 or self._done == self._gen:
                return True
            gen = self._gen
        done, error = self._query_event()
        if not done:
            return False
        self._finish(gen, error)
        with self._lock:  # False while a staged copy before this point is still at work
            return gen != self._gen or self._done == gen

    def error(self) -> BaseException | None:
        """A new copy of the failure each time: the caller raises it, which attaches the
        raising frames, and the one kept here must not keep them (and their tensors) alive."""
        with self._lock:
            error = self._error
        return None if error is None else copy.copy(error).with_traceback(None)

    def add_done_callback(self, fn: Callable[[], None]) -> bool:
        with self._lock:
            finished = self._gen == 0 or self._done == self._gen
            if not finished:
                self._callbacks.append(fn)
                arm = self._armed != self._gen
                self._armed = self._gen
                gen = self._gen
        if finished:
            fn()
            return True
        if arm:
            self._arm(gen)
        return True

    def _arm(self, gen: int) -> None:
        stream = self._stream
        dispatcher = stream.dispatcher
        check = functools.partial(self._check, gen)
        if stream.wake != "poll":  # "auto" (a bounded poll first) or "hostfn"
            with stream.lock:
                if not stream.closed and stream.seq == self._seq:
                    dispatcher.watch_ordered(stream.key, check, poll_first=stream.wake == "auto")
                    with ctx_current(stream.device.ctx):
                        err = launch_host_func(
                            stream.handle, dispatcher.post_address, dispatcher.post_argument
                        )
                    if err == 0:
                        return
                    # A sticky context error (or any failure): poll this one. The entry left
                    # in the FIFO finishes before anything later on the stream, so it is harmless.
                    stream.hostfn_failures += 1
        dispatcher.watch_polled(check)

    def __repr__(self) -> str:
        state = "idle" if self._gen == 0 else ("done" if self._done == self._gen else "pending")
        return f"<CudaNotification {state} on {self._stream!r}>"
