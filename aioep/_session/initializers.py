"""``load_initializers``: put a model's initializer bytes from their files straight into
device memory, through external data loaders (ORT's ``IExternalDataLoader``).

A factory offers a loader through ``create_external_data_loader()``; the
environment picks the first registered one whose ``can_load`` accepts the
destination's memory info. Devices whose factory offers none use the built-in
[`ChunkedExternalDataLoader`][aioep.abc.ChunkedExternalDataLoader]. Every initializer is
validated (see `aioep._session.external_data`) before anything is allocated.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import PurePath
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from .._base.errors import DeviceError, EpError, InUseError, InvalidArgument, NotImplementedByEp
from .._base.progress import ProgressBar, wants_bar
from .._base.types import MemoryInfo, MemoryType
from .._copies.chunked_loader import DEFAULT_CHUNK_BYTES, ChunkedExternalDataLoader
from .._plugin.device import EpDevice
from .._plugin.loader import ExternalDataLoader
from .._plugin.stream import SyncStream, check_open
from .external_data import InitializerSpec, read_initializers

if TYPE_CHECKING:
    from .._plugin.tensor import Tensor
    from .host import SessionHost

__all__ = ["ExternalDataLoader", "load_initializers"]

ProgressCallback = Callable[[int, int], object]


class _Progress:
    """Counts loaded bytes; drives a progress bar and/or the user's callback."""

    def __init__(self, total: int, desc: str, bar: bool, callback: ProgressCallback | None) -> None:
        self.done = 0
        self.total = total
        self._callback = callback
        self._bar = ProgressBar(total, desc, bar)

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        self._bar.update(nbytes)
        if self._callback is not None:
            self._callback(self.done, self.total)

    def close(self) -> None:
        self._bar.close()


async def load_initializers(
    env: SessionHost,
    model: str | os.PathLike[str],
    ep_device: EpDevice,
    names: Sequence[str] | None = None,
    *,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    stream: SyncStream | None = None,
    loader: ExternalDataLoader | None = None,
) -> dict[str, Tensor]:
    """Load a model's initializers into the DEFAULT memory of ``ep_device``.

    The graph is read with ``onnx`` without its external data; every chosen
    initializer (all of them, or ``names``) is validated before anything is
    allocated: external data locations must stay inside the model's directory,
    offsets and lengths must be in range and match the tensor's size, and the
    files must exist. Each tensor is then allocated from the shared allocator;
    external data is read by the loader (``loader``, else the first registered
    one that can load into the memory, else the built-in chunked loader, which
    reads ``chunk_bytes`` at a time through host-accessible staging buffers) and
    inline data is copied.

    Args:
        env: the open environment.
        model: path of the ``.onnx`` file.
        ep_device: where the tensors go.
        names: initializers to load (default: every one in the main graph).
        progress: show a tqdm bar (silently none when tqdm is not installed); None (the
            default): when standard error is a terminal.
        on_progress: called as ``on_progress(done_bytes, total_bytes)`` on the
            event loop as data lands.
        chunk_bytes: read size (and staging buffer size) of the built-in loader.
        stream: a stream of ``ep_device`` to copy on (default: a stream of its
            own when the device supports streams).
        loader: use this loader instead of choosing one.

    Returns:
        initializer name -> tensor, in graph order (or the order of ``names``),
        with all data in place. All or nothing: on any failure or cancellation
        every tensor allocated so far is freed once no device work uses it.

    Raises:
        NoSuchFile: the model or an external data file does not exist.
        InvalidArgument: a bad argument, or an initializer that breaks a rule.
        EpError: reading or copying failed (the cause is chained).
    """
    info = _checked_memory(env, model, ep_device, names, chunk_bytes, on_progress, stream, loader)
    show = wants_bar(progress, "load_initializers")
    model_path = os.fspath(model)
    names_list = None if names is None else list(names)
    # Everything is validated here, before any allocation or read.
    specs = await anyio.to_thread.run_sync(read_initializers, model_path, names_list)
    chosen, builtin = _choose_loader(env, info, specs, loader, chunk_bytes)
    tracker = _Progress(
        sum(s.nbytes for s in specs),
        f"{PurePath(model_path).name} -> {info.name}",
        show,
        on_progress,
    )
    return await _load_all(env, ep_device, info, specs, chosen, builtin, stream, tracker)


def _checked_memory(
    env: SessionHost,
    model: str | os.PathLike[str],
    ep_device: EpDevice,
    names: Sequence[str] | None,
    chunk_bytes: int,
    on_progress: ProgressCallback | None,
    stream: SyncStream | None,
    loader: ExternalDataLoader | None,
) -> MemoryInfo:
    """Check ``load_initializers``' arguments; return the DEFAULT memory of ``ep_device``."""
    if not isinstance(ep_device, EpDevice):
        raise InvalidArgument(
            f"load_initializers: ep_device must be an EpDevice, got {ep_device!r}"
        )
    env.check_device(ep_device)
    info = ep_device.memory_info(MemoryType.DEFAULT)
    if info is None:
        raise InvalidArgument(f"load_initializers: {ep_device!r} has no DEFAULT memory")
    if not isinstance(model, (str, os.PathLike)):
        raise InvalidArgument(
            f"load_initializers: model must be the path of an .onnx file, got {type(model).__name__}"
        )
    if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)):
        raise InvalidArgument(f"load_initializers: names must be a list of str, got {names!r}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise InvalidArgument(
            f"load_initializers: chunk_bytes must be an int >= 1, got {chunk_bytes!r}"
        )
    if on_progress is not None and not callable(on_progress):
        raise InvalidArgument(
            f"load_initializers: on_progress must be callable, got {on_progress!r}"
        )
    if stream is not None:
        if not isinstance(stream, SyncStream):
            raise InvalidArgument(f"load_initializers: stream must be a SyncStream, got {stream!r}")
        check_open(stream)
        if stream.ep_device is not ep_device:
            raise InvalidArgument(
                f"load_initializers: {stream!r} belongs to {stream.ep_device!r}, not {ep_device!r}"
            )
    if loader is not None and not isinstance(loader, ExternalDataLoader):
        raise InvalidArgument(
            f"load_initializers: loader must be an ExternalDataLoader, got {loader!r}"
        )
    return info


def _choose_loader(
    env: SessionHost,
    info: MemoryInfo,
    specs: Sequence[InitializerSpec],
    loader: ExternalDataLoader | None,
    chunk_bytes: int,
) -> tuple[ExternalDataLoader | None, ChunkedExternalDataLoader | None]:
    """The loader for the external data: ``loader``, else the environment's choice, else
    the built-in chunked loader (also returned second: the caller closes it)."""
    external = [s for s in specs if s.external is not None and s.nbytes]
    chosen = loader if loader is not None else env.external_data_loader(info)
    builtin: ChunkedExternalDataLoader | None = None
    if external and chosen is None:
        largest = max(s.nbytes for s in external)
        builtin = ChunkedExternalDataLoader(env, chunk_bytes=min(chunk_bytes, largest))
        if not builtin.can_load(info):
            raise NotImplementedByEp(
                f"load_initializers: no data transfer copies from host memory to {info.device}, "
                "and no external data loader can load into it"
            )
        chosen = builtin
    elif chosen is not None and external and not chosen.can_load(info):
        raise InvalidArgument(f"load_initializers: {chosen!r} cannot load into {info.name!r}")
    return chosen, builtin


async def _load_all(
    env: SessionHost,
    ep_device: EpDevice,
    info: MemoryInfo,
    specs: Sequence[InitializerSpec],
    chosen: ExternalDataLoader | None,
    builtin: ChunkedExternalDataLoader | None,
    stream: SyncStream | None,
    tracker: _Progress,
) -> dict[str, Tensor]:
    """Allocate every tensor, then fill them one by one; all or nothing."""
    own_stream: SyncStream | None = None
    tensors: dict[str, Tensor] = {}
    ok = False
    try:
        if stream is None and not info.device.is_host_accessible:
            try:
                own_stream = env.create_sync_stream(ep_device)
            except NotImplementedByEp:
                own_stream = None
        use = stream if stream is not None else own_stream
        for spec in specs:
            tensors[spec.name] = env.empty(spec.shape, spec.dtype, info, stream=use)
        for spec in specs:
            if spec.nbytes:
                await _load_one(env, spec, tensors[spec.name], chosen, builtin, use, tracker)
        if use is not None:
            await use.synchronize()
        ok = True
        return tensors
    finally:
        with anyio.CancelScope(shield=True):
            await _cleanup(own_stream, stream, builtin, tracker, ok)
        if not ok:
            _free_all(tensors)


async def _load_one(
    env: SessionHost,
    spec: InitializerSpec,
    tensor: Tensor,
    loader: ExternalDataLoader | None,
    builtin: ChunkedExternalDataLoader | None,
    stream: SyncStream | None,
    tracker: _Progress,
) -> None:
    ext = spec.external
    try:
        if ext is None:
            assert spec.inline is not None
            await env.copy_tensors([spec.inline], [tensor], stream)
            tracker(spec.nbytes)
        elif builtin is not None and loader is builtin:
            await builtin.load_tensor(
                ext.path, ext.offset, ext.length, tensor, stream=stream, on_progress=tracker
            )
        else:
            assert loader is not None
            await loader.load_tensor(ext.path, ext.offset, ext.length, tensor, stream=stream)
            tracker(spec.nbytes)
    except Exception as exc:
        where = f"loading initializer {spec.name!r}"
        if ext is not None:
            where += f" from {ext.location!r} (offset {ext.offset}, {ext.length} bytes)"
        if isinstance(exc, EpError):
            try:
                error: EpError = type(exc)(f"{where}: {exc}", code=exc.code)
            except Exception:
                raise exc from None
        else:
            error = DeviceError(f"{where} failed: {type(exc).__name__}: {exc}")
        raise error from exc


async def _cleanup(
    own_stream: SyncStream | None,
    stream: SyncStream | None,
    builtin: ChunkedExternalDataLoader | None,
    tracker: _Progress,
    ok: bool,
) -> None:
    if own_stream is not None:
        await own_stream.aclose()  # waits for the work on it first
    elif stream is not None and not ok and not stream.closed:
        try:
            await stream.synchronize()  # nothing may still write into tensors we free
        except Exception:
            pass
    if builtin is not None:
        builtin.close()
    tracker.close()


def _free_all(tensors: dict[str, Tensor]) -> None:
    for tensor in tensors.values():
        try:
            tensor.buffer.free()
        except InUseError:  # still pinned by device work: freed when that work drops it
            pass
    tensors.clear()
