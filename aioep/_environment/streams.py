"""An environment's streams: made on a library's EP device, lent from its pools
(`Environment.pooled_stream`), synchronized and closed when the environment closes."""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .._base.errors import EpError, InvalidArgument, NotImplementedByEp, translate_backend_error
from .._base.types import MemoryDevice, MemoryType
from .._plugin.device import EpDevice
from .._plugin.factory import EpFactory
from .._plugin.stream import SyncStream
from .._plugin.stream_impl import StreamImpl
from .._plugin.thread_stream import HostNotification
from .library import Library
from .stream_pool import PooledStream, Reservation, StreamLease, StreamRing

__all__ = ["LibraryStreams", "make_stream_impl", "quietly"]


class LibraryStreams:
    """The streams of an environment's libraries: each library's open streams and stream
    pools live in its `Library` record; this makes, lends, synchronizes and closes them.

    ``libraries`` is the registry's own name -> library map; ``library_of`` its lookup of
    the library of an EP device (raises for a device of another environment).
    """

    def __init__(
        self,
        libraries: Mapping[str, Library],
        library_of: Callable[[EpDevice], Library],
        lock: threading.RLock,
    ) -> None:
        self._libraries = libraries
        self._library_of = library_of
        self._lock = lock

    def create_stream(self, ep_device: EpDevice, options: Mapping[str, Any] | None) -> SyncStream:
        """A new stream on ``ep_device`` (see `Environment.create_sync_stream`)."""
        with self._lock:
            lib, factory, memory = self._stream_maker(ep_device)
            impl = make_stream_impl(factory, memory, options)
            stream = SyncStream(impl, ep_device, on_close=lib.streams.discard)
            lib.streams.add(stream)
            return stream

    def _stream_maker(self, ep_device: EpDevice) -> tuple[Library, EpFactory, MemoryDevice]:
        # Under self._lock: the library, its factory and the memory a stream would run on.
        lib = self._library_of(ep_device)
        info = ep_device.memory_info(MemoryType.DEFAULT)
        if info is None:
            raise InvalidArgument(f"{ep_device!r} has no DEFAULT memory to run a stream on")
        if not lib.factory.is_stream_aware():
            raise NotImplementedByEp(
                f"The execution provider {lib.factory.name!r} does not support streams."
            )
        return lib, lib.factory, info.device

    def lend_stream(
        self, ep_device: EpDevice, size: int
    ) -> PooledStream | Reservation | HostNotification:
        """A stream of ``ep_device``'s pool (at most ``size`` streams), counted as lent; or a
        `Reservation` the caller fills with `make_pooled_stream` (off the event
        loop); or, while the streams are all being made, a notification to await before
        asking again."""
        with self._lock:
            lib, _, _ = self._stream_maker(ep_device)
            ring = lib.pools.get(ep_device)
            if ring is None:
                ring = lib.pools[ep_device] = StreamRing()
            got = ring.pick(size)
            if isinstance(got, PooledStream):
                got.borrowed()
            return got

    def lease(self, ep_device: EpDevice, size: int, check_open: Callable[[], None]) -> StreamLease:
        """The lease of `Environment.pooled_stream`: a stream of ``ep_device``'s pool (at
        most ``size`` streams), lent while ``check_open()`` passes."""

        def lend() -> PooledStream | Reservation | HostNotification:
            check_open()
            return self.lend_stream(ep_device, size)

        return StreamLease(
            lend, functools.partial(self.make_pooled_stream, ep_device), self.give_back
        )

    def make_pooled_stream(self, ep_device: EpDevice, reservation: Reservation) -> None:
        """Make the stream ``reservation`` holds a place for and add it to the pool.

        Blocking (a driver may wait in its stream creation): call it off the event loop. The
        environment's lock is not held meanwhile; the reservation keeps the library in use.
        """
        stream: PooledStream | None = None
        try:
            with self._lock:
                lib, factory, memory = self._stream_maker(ep_device)
            impl = make_stream_impl(factory, memory, None)
            with self._lock:
                stream = PooledStream(impl, ep_device, on_close=lib.streams.discard)
                lib.streams.add(stream)
        finally:
            with self._lock:
                reservation.fill(stream)

    def give_back(self, stream: PooledStream) -> None:
        """A borrower is done with ``stream`` (its work may still be in flight)."""
        with self._lock:
            stream.returned()

    def open_streams(self) -> list[SyncStream]:
        """Every stream still open, library by library."""
        return [s for lib in self._libraries.values() for s in list(lib.streams)]

    async def synchronize_streams(self) -> None:
        """Wait for the work enqueued on every open stream (failures are ignored here)."""
        for stream in self.open_streams():
            try:
                await stream.synchronize()
            except Exception:
                pass

    def close_streams(self) -> list[str]:
        """Close the pooled streams, then the streams still open; returns the reprs of
        those still lent or open (for the close report)."""
        found = []
        for lib in self._libraries.values():
            found += self.close_pools(lib, report=True)
        for stream in self.open_streams():
            found.append(repr(stream))
            stream.close()
        return found

    def close_pools(self, lib: Library, *, report: bool) -> list[str]:
        """Retire ``lib``'s pooled streams; returns those still lent (``report``: for the
        close report)."""
        # A stream still being made joins its ring when made: wait for it (never the case
        # when unregistering: a stream being made keeps the library in use).
        for ring in list(lib.pools.values()):
            for reservation in list(ring.making):
                reservation.made.wait_on_host(None)
        with self._lock:
            pooled = [s for ring in lib.pools.values() for s in ring.streams]
            lib.pools.clear()
        lent = []
        for stream in pooled:
            if report and stream.lent:
                lent.append(f"{stream!r} (still lent by env.pooled_stream())")
            quietly(stream.retire, f"pooled stream {stream!r}")
        return lent


def make_stream_impl(
    factory: EpFactory, memory: MemoryDevice, options: Mapping[str, Any] | None
) -> StreamImpl:
    """The factory's new stream for ``memory``, checked; backend errors translated."""
    try:
        impl = factory.create_sync_stream(memory, options)
    except Exception as exc:
        raise translate_backend_error(exc, f"{factory.name!r} create_sync_stream") from exc
    if impl is None:
        raise EpError(
            f"Failed to get a stream implementation from the EP factory {factory.name!r}."
        )
    if not isinstance(impl, StreamImpl):
        raise InvalidArgument(
            f"factory {factory.name!r}.create_sync_stream returned {impl!r}, not an "
            "aioep.abc.StreamImpl"
        )
    return impl


def quietly(fn: Any, what: str) -> None:
    """Call ``fn``; a failure is a warning naming ``what`` (closing goes on)."""
    try:
        fn()
    except Exception as exc:
        warnings.warn(
            f"closing {what} failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3
        )
