"""`ThreadStream`: a ready `StreamImpl` whose device work runs in order on one worker thread,
its notification (`HostNotification`), and error lanes (one borrower's share of a shared
stream's failures)."""

from __future__ import annotations

import collections
import contextvars
import functools
import itertools
import threading
from collections.abc import Callable

from .._base.errors import ClosedError, NotImplementedByEp
from .stream_impl import NotificationImpl, StreamImpl, run_callbacks
from .wake import flush_wakeups, hold_wakeups

__all__ = ["ErrorLane", "HostNotification", "ThreadStream", "enter_lane", "leave_lane"]


class ErrorLane:
    """One borrower's share of a `ThreadStream` that several borrowers use at once
    (``env.pooled_stream``): where a failure of the borrower's work is reported.

    While a context (a task, with the tasks it starts) has a lane on a stream entered
    (`enter_lane`), a failure of work it enqueues there is reported by the next mark it
    records there, never by another borrower's mark nor by a mark recorded outside the lane.
    A sticky error (a lost device, `ThreadStream.sticky_error`) still reaches every mark.
    """

    __slots__ = ("error", "stream")

    def __init__(self, stream: StreamImpl) -> None:
        self.stream = stream
        self.error: BaseException | None = None  # under the stream's lock


# The lanes the current context has entered, innermost last.
_lanes: contextvars.ContextVar[tuple[ErrorLane, ...]] = contextvars.ContextVar(
    "aioep_error_lanes", default=()
)


def enter_lane(stream: StreamImpl) -> contextvars.Token[tuple[ErrorLane, ...]]:
    """Give the current context a lane of its own on ``stream``; `leave_lane` ends it.

    Only a `ThreadStream` reads lanes; on any other stream this changes nothing.
    """
    return _lanes.set((*_lanes.get(), ErrorLane(stream)))


def leave_lane(token: contextvars.Token[tuple[ErrorLane, ...]]) -> None:
    """End the lane that `enter_lane` returned ``token`` for (in the same context)."""
    try:
        _lanes.reset(token)
    except (ValueError, RuntimeError):  # ended from another context, or twice: nothing to undo
        pass


def _lane_of(stream: StreamImpl) -> ErrorLane | None:
    lanes = _lanes.get()
    return _lane_in(lanes, stream) if lanes else None


def _lane_in(lanes: tuple[ErrorLane, ...], stream: StreamImpl) -> ErrorLane | None:
    for lane in reversed(lanes):
        if lane.stream is stream:
            return lane
    return None


class HostNotification(NotificationImpl):
    """A notification completed by host code: [`set`][aioep.abc.HostNotification.set] from any
    thread.

    Used by [`ThreadStream`][aioep.abc.ThreadStream] (its worker sets it when it reaches the mark)
    and by the core for copies that run without a stream.
    """

    __slots__ = (
        "_callbacks",
        "_done",
        "_error",
        "_generation",
        "_lane",
        "_lock",
        "_passed",
        "_passed_waiters",
        "_stream",
    )

    def __init__(self, stream: ThreadStream | None = None) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._done = False  # read without the lock: a bool flip is atomic
        self._callbacks: list[Callable[[], None]] = []
        self._error: BaseException | None = None
        self._generation = 0
        self._lane: ErrorLane | None = None  # the lane the current mark was recorded in
        # The last mark (generation) the stream reached, superseded or not, and device-side
        # waiters for a given mark (made on first use): a wait captures the mark current
        # when it is enqueued (cuStreamWaitEvent), so re-activating later never makes it
        # wait for a new mark.
        self._passed = 0
        self._passed_waiters: list[tuple[int, Callable[[], None]]] | None = None

    def activate(self) -> None:
        stream = self._stream
        if stream is None:
            return
        lanes = _lanes.get()
        lane = _lane_in(lanes, stream) if lanes else None
        lock = self._lock
        lock.acquire()  # nothing below can raise: no try/finally needed
        self._generation = generation = self._generation + 1
        self._done = False
        self._error = None
        self._lane = lane
        lock.release()
        stream._enqueue_signal(self, generation)

    def set(self, error: BaseException | None = None, *, generation: int | None = None) -> bool:
        """Mark complete (with the failure of the work before it, if any) and run callbacks.

        Returns False, doing nothing, when ``generation`` names a mark that a later
        `activate` superseded.
        """
        callbacks = self._mark(error, generation)
        if callbacks is None:
            return False
        if callbacks:
            run_callbacks(callbacks)
        return True

    def _mark(
        self, error: BaseException | None, generation: int | None
    ) -> list[Callable[[], None]] | None:
        # Complete without running callbacks; returns them, or None if the mark was superseded.
        released: list[Callable[[], None]] | None = None
        lock = self._lock
        lock.acquire()
        try:
            current = self._generation
            passed = current if generation is None else generation
            if passed > self._passed:
                self._passed = passed
                waiters = self._passed_waiters
                if waiters:
                    released = [fn for g, fn in waiters if g <= passed]
                    self._passed_waiters = [w for w in waiters if w[0] > passed]
            if passed != current:
                callbacks = None  # superseded
            else:
                self._error = error
                self._done = True
                callbacks, self._callbacks = self._callbacks, []
        finally:
            lock.release()
        if released:
            for fn in released:
                fn()  # a waiting stream's Event.set: cheap, safe under the caller's lock
        return callbacks

    def _wait_passed(self, generation: int) -> None:
        """Block (a stream's worker) until the stream passed mark ``generation``."""
        with self._lock:
            if self._passed >= generation:
                return
            event = threading.Event()
            if self._passed_waiters is None:
                self._passed_waiters = []
            self._passed_waiters.append((generation, event.set))
        event.wait()

    def query(self) -> bool:
        return self._done

    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[], None]) -> bool:
        lock = self._lock
        lock.acquire()
        if not self._done:
            self._callbacks.append(fn)
            lock.release()
            return True
        lock.release()
        fn()
        return True

    def wait_on_host(self, timeout: float | None) -> bool:
        if self._done:
            return True
        # Only blocking waiters pay for an Event; awaiting tasks never create one.
        event = threading.Event()
        self.add_done_callback(event.set)
        return event.wait(timeout)

    def wait_on_device(self, stream: StreamImpl) -> None:
        if not isinstance(stream, ThreadStream):
            raise NotImplementedByEp(
                f"{type(stream).__name__} cannot wait on a host-signalled notification on the "
                "device; await the notification first"
            )
        stream.enqueue_wait(self)


_Op = tuple[str, object, int]
_stream_ids = itertools.count()
_new_host_notification = HostNotification.__new__
_allocate_lock = threading.Lock


class ThreadStream(StreamImpl):
    """A stream whose work runs strictly in order on one dedicated worker thread.

    ``enqueue(fn)`` queues a callable; if it raises, the error is attached to
    the next notification recorded after it and the stream goes on with the
    work after it. Where borrowers share the stream, each in an `ErrorLane`
    of its own, that is the next notification the same borrower records: another
    borrower's marks never report it. ``enqueue_wait(n)`` parks the worker (the "device") until
    notification ``n`` of any backend completes: a device-side wait, the host
    is not blocked.

    The worker wakes the event loops awaiting the marks it passes once it has passed all
    those in a row, before it runs the work behind them or parks: a woken loop finds the
    interpreter free.

    When the stream is idle (nothing queued, nothing running), a notification
    recorded on it completes at once, and `run_inline` (or
    ``enqueue(fn, inline=True)``) runs ``fn`` on the calling thread, as a driver does
    with a small pageable copy. Only run work inline that never blocks (a small memcpy);
    the core does so for copies within the environment's inline budget.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"aioep-stream-{next(_stream_ids)}"
        self._lock = threading.Lock()
        # The idle worker sleeps on _wakeup, a lock it holds: whoever queues work for a
        # sleeping worker releases it, once per sleep (_sleeping, under _lock, says when).
        # Acquiring a lock parks the worker in C, without the Python a Condition runs on
        # both sides of every wake-up.
        self._wakeup = threading.Lock()
        self._wakeup.acquire()
        self._sleeping = False
        self._queue: collections.deque[_Op] = collections.deque()
        self._pending_error: BaseException | None = None
        # An op is running (on the worker or inline on a caller). The worker sets it before
        # it takes an op off the queue, so a reader that looks at the queue first, then at
        # this, never sees an idle stream while work is in flight (query() takes no lock).
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    @property
    def handle(self) -> int:
        return self._thread.ident or 0

    def create_notification(self) -> HostNotification:
        return HostNotification(self)

    def _new_mark(self) -> HostNotification:
        """A new notification in the state `HostNotification.activate` leaves it in, its
        signal not enqueued yet (`_enqueue_signal` with generation 1 does that): the
        core's ``SyncStream.record`` in fewer steps."""
        note = _new_host_notification(HostNotification)
        note._stream = self
        note._lock = _allocate_lock()
        note._done = False
        note._callbacks = []
        note._error = None
        note._generation = 1
        lanes = _lanes.get()
        note._lane = _lane_in(lanes, self) if lanes else None
        note._passed = 0
        note._passed_waiters = None
        return note

    def query(self) -> bool | None:
        return not self._queue and not self._busy  # in this order (see _busy)

    def settled(self) -> bool:
        # A failure waiting in the caller's error lane is the caller's to see: a mark it
        # records now reports it, so it is not settled (another borrower's lane is not its).
        lane = _lane_of(self)
        with self._lock:
            if self._queue or self._busy or self._pending_error is not None:
                return False
            if lane is not None and lane.error is not None:
                return False
        return self.sticky_error() is None

    def enqueue(self, fn: Callable[[], None], *, inline: bool = False) -> None:
        """Queue ``fn`` to run after everything queued before it.

        With ``inline=True`` and an idle stream, run it now on this thread instead.
        """
        fn = self._in_lane(fn)
        if inline and self._run_now(fn):
            return
        self._put(("op", fn, 0))

    def _in_lane(self, fn: Callable[[], None]) -> Callable[[], None]:
        # The op of a borrower in an error lane: its failure waits for that borrower's mark.
        lanes = _lanes.get()
        lane = _lane_in(lanes, self) if lanes else None
        return fn if lane is None else functools.partial(self._run_in_lane, fn, lane)

    def run_inline(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` now, on this thread, if the stream is idle; return False (doing
        nothing) if work is queued or running.

        ``fn`` then runs in the stream's order: nothing is ahead of it, and work enqueued
        meanwhile waits for it. If it raises, the error goes to the next notification the
        stream reaches, as for queued work (in a borrower's `ErrorLane`: the next
        notification that borrower records).
        """
        return self._run_now(self._in_lane(fn))

    def _run_now(self, fn: Callable[[], None]) -> bool:
        with self._lock:
            self._check_not_closed()
            if self._queue or self._busy:
                return False
            self._busy = True
        try:
            self._run_op(fn)
        finally:
            with self._lock:
                self._busy = False
                if self._queue:
                    self._wake_worker()
        return True

    def enqueue_wait(self, notification: NotificationImpl) -> None:
        """Queue a device-side wait: work after this waits until ``notification`` completes.

        For a notification of a stream, the wait is for the mark it has now: activating
        it again later moves its mark but not this wait (as ``cuStreamWaitEvent``).
        """
        if isinstance(notification, HostNotification) and notification._stream is not None:
            self._put(("wait", notification, notification._generation))
        else:
            self._put(("wait", notification, -1))

    def _enqueue_signal(self, notification: HostNotification, generation: int) -> None:
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                self._check_not_closed()
            if self._queue or self._busy:
                self._queue.append(("signal", notification, generation))
                if self._sleeping and not self._busy:
                    self._wake_worker()
                return
            lane = notification._lane
            error = self._take_error(lane)
        finally:
            lock.release()
        # The stream already passed this point: complete it here (callbacks run on this thread).
        if not notification.set(error, generation=generation) and error is not None:
            self._keep_error(error, lane)

    def _wake_worker(self) -> None:
        # Under self._lock, with work queued: wake the worker if it sleeps (and no inline op
        # holds the stream: its end wakes it then).
        if self._sleeping and not self._busy:
            self._sleeping = False
            self._wakeup.release()

    def _check_not_closed(self) -> None:
        if self._closed:
            raise ClosedError(f"stream {self.name} is closed")

    def _put(self, op: _Op) -> None:
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                self._check_not_closed()
            self._queue.append(op)
            if self._sleeping and not self._busy:
                self._wake_worker()
        finally:
            lock.release()

    def _keep_error(self, error: BaseException, lane: ErrorLane | None = None) -> None:
        # A superseded mark (re-activated notification) must not swallow a failure.
        with self._lock:
            self._store_error(error, lane)

    def _store_error(self, error: BaseException, lane: ErrorLane | None) -> None:
        # Under self._lock: the first failure since the lane's (or the stream's) last mark.
        if lane is None:
            if self._pending_error is None:
                self._pending_error = error
        elif lane.error is None:
            lane.error = error

    def _take_error(self, lane: ErrorLane | None = None) -> BaseException | None:
        # Called under self._lock when the stream reaches a mark (recorded in ``lane``).
        if lane is None:
            error, self._pending_error = self._pending_error, None
        else:
            error, lane.error = lane.error, None
        return error if error is not None else self.sticky_error()

    def sticky_error(self) -> BaseException | None:
        """Hook: an error every mark reports from now on (a lost device), else None."""
        return None

    def on_error(self, exc: BaseException) -> None:
        """Hook: called on the thread that ran a failed op (a backend may mark the device lost)."""

    def _run_op(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            self.on_error(exc)
            self._keep_error(exc)

    def _run_in_lane(self, fn: Callable[[], None], lane: ErrorLane) -> None:
        # The op of a borrower: its failure waits for that borrower's next mark.
        try:
            fn()
        except BaseException as exc:
            self.on_error(exc)
            self._keep_error(exc, lane)

    def _run(self) -> None:
        lock, queue, wakeup = self._lock, self._queue, self._wakeup
        # The loops that marks passed here wake are woken when this thread has nothing
        # else to do first: before it runs more work, or right before it parks.
        held = hold_wakeups()
        lock.acquire()
        while True:  # holding lock at the top of every turn
            if not queue or self._busy:
                if self._closed and not queue:
                    lock.release()
                    flush_wakeups(held)
                    return
                self._sleeping = True
                lock.release()
                if held:
                    flush_wakeups(held)
                wakeup.acquire()  # parked until _wake_worker releases it
                lock.acquire()
                continue
            self._busy = True  # before the queue reads empty (see __init__)
            kind, obj, generation = queue.popleft()
            if kind == "signal":
                # Mark it done before the stream reads as idle, and wake waiters only
                # after: whoever a mark wakes sees the stream past it.
                try:
                    lane = obj._lane  # type: ignore[attr-defined]
                    error = self._take_error(lane)
                    callbacks = obj._mark(error, generation)  # type: ignore[attr-defined]
                    if callbacks is None and error is not None:
                        self._store_error(error, lane)  # superseded mark: keep the failure
                finally:
                    self._busy = False
                    lock.release()
                del lane, error, obj
                if callbacks:
                    run_callbacks(callbacks)
                del callbacks
                lock.acquire()
                continue
            lock.release()
            if held:
                flush_wakeups(held)
            try:
                if kind == "op":
                    self._run_op(obj)  # type: ignore[arg-type]
                else:
                    # Like cuStreamWaitEvent: order only; a failure upstream is not inherited.
                    if generation >= 0:
                        obj._wait_passed(generation)  # type: ignore[attr-defined]
                    else:
                        obj.wait_on_host(None)  # type: ignore[attr-defined]
            finally:
                del obj
                lock.acquire()
                self._busy = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._sleeping:
                self._sleeping = False
                self._wakeup.release()
        if threading.current_thread() is not self._thread:
            self._thread.join()
