"""Streams of ORT plugin EPs that support them (``OrtEpDevice.create_sync_stream``)."""

from __future__ import annotations

from typing import Any

from aioep.abc import ThreadStream

from ._registry import Registration

__all__ = ["OrtStream"]


class OrtStream(ThreadStream):
    """An ORT ``OrtSyncStream`` with aioep's in-order worker thread.

    ORT's Python binding offers no notification or host wait for a sync stream,
    so copies enqueued here run synchronously, in order, on the worker thread:
    completion is then exact. `handle` is the native stream handle
    (``OrtSyncStream.get_handle()``), for handing to ORT sessions.
    """

    def __init__(self, ort_stream: Any, registration: Registration, name: str) -> None:
        super().__init__(name)
        self._ort_stream: Any = ort_stream
        self._registration = registration
        self._handle = int(ort_stream.get_handle() or 0)
        registration.value_created()  # ORT must not unregister the library under this stream

    @property
    def handle(self) -> int:
        return self._handle

    @property
    def ort_stream(self) -> Any:
        """The ``onnxruntime.OrtSyncStream`` (None after `close`)."""
        return self._ort_stream

    def close(self) -> None:
        super().close()
        if self._ort_stream is not None:
            self._ort_stream = None
            self._registration.value_released()
