"""Foreign tensors: objects that expose only ``__dlpack__`` / ``__dlpack_device__`` or only
``__cuda_array_interface__``, over host memory, sim device memory and (emulated) CUDA
memory, taken zero-copy by ``copy_tensors``, ``Session.run`` and ``IOBinding``; the stream
handshake both ways; and the producer's lifetime while aioep uses its memory.

The producers here build their capsules themselves with ctypes (legacy ``"dltensor"`` and
DLPack 1.x ``"dltensor_versioned"``), count their deleter calls and honour the capsule
rename, as PyTorch, CuPy and JAX do; none of them is an aioep object.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from _factories import MakeEnv

import aioep
from aioep import InvalidArgument, MemoryType
from aioep._memory.dlpack import (
    DLDataType,
    DLDevice,
    DLManagedTensor,
    DLManagedTensorVersioned,
    DLPackVersion,
)

pytest.importorskip("aioep_sim")

pytestmark = pytest.mark.anyio

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_ROCM, KDL_EXT_DEV = 1, 2, 3, 10, 12
# Where long double is IEEE binary128 (aarch64 Linux), DLPack's float128 is numpy's.
_BINARY128 = np.finfo(np.longdouble).nmant == 112


# -- test producers --------------------------------------------------------------------------
_READ_ONLY = (
    "is read-only"
    if int(np.__version__.split(".")[0]) >= 2
    # numpy 1.x cannot mark an export read-only, so it refuses to export a read-only array:
    # aioep passes the producer's refusal on (the versioned-capsule test covers the flag).
    else "could not be read through DLPack: Cannot export readonly array"
)


class DLPackOnly:
    """Delegates ``__dlpack__`` / ``__dlpack_device__`` to ``inner`` and records each call's
    keyword arguments (nothing else: no array interface, no buffer protocol)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[dict[str, Any]] = []

    def __dlpack__(self, **kwargs: Any) -> Any:
        capsule = self.inner.__dlpack__(**kwargs)
        # Only the calls that gave a capsule: a consumer retries without ``max_version``
        # where the inner producer predates DLPack 1.0 (numpy 1.x).
        self.calls.append(kwargs)
        return capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return tuple(self.inner.__dlpack_device__())  # type: ignore[return-value]


_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.pythonapi["PyCapsule_New"]
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _Destructor]
_capsule_is_valid = ctypes.pythonapi["PyCapsule_IsValid"]
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi["PyCapsule_GetName"]
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]

# Managed tensors handed out and not yet deleted: address -> (producer, structs kept alive).
_handed_out: dict[int, tuple[Any, tuple[Any, ...]]] = {}
_handed_lock = threading.Lock()


def _delete_at(addr: int) -> None:
    with _handed_lock:
        entry = _handed_out.pop(addr, None)
    if entry is None:
        raise AssertionError(f"deleter called twice (or for an unknown tensor) at {addr:#x}")
    entry[0].deleted += 1


def _deleter_legacy(managed: Any) -> None:
    _delete_at(ctypes.cast(managed, ctypes.c_void_p).value or 0)


def _deleter_versioned(managed: Any) -> None:
    _delete_at(ctypes.cast(managed, ctypes.c_void_p).value or 0)


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))(_deleter_legacy)
_DELETER_V = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))(_deleter_versioned)


def _destroy(capsule: int | None) -> None:
    # Unconsumed (the name is unchanged): the capsule still owns the tensor.
    for name in (b"dltensor", b"dltensor_versioned"):
        if capsule and _capsule_is_valid(capsule, name):
            _delete_at(_capsule_pointer(capsule, name) or 0)


_DESTRUCTOR = _Destructor(_destroy)


class CapsuleProducer:
    """Exposes memory at ``ptr`` through ``__dlpack__`` only, with capsules it builds itself.

    ``versioned`` picks DLPack 1.x capsules (when the consumer passes ``max_version``);
    ``readonly`` sets the 1.x read-only flag. ``deleted`` counts deleter calls (one per
    consumed capsule); ``keep`` is what the producer holds alive (its "storage").
    ``on_dlpack(stream)`` runs inside ``__dlpack__`` (a producer ordering its work).
    """

    def __init__(
        self,
        ptr: int,
        shape: tuple[int, ...],
        dtype: tuple[int, int, int],
        device: tuple[int, int],
        *,
        keep: Any = None,
        versioned: bool = True,
        readonly: bool = False,
        strides: tuple[int, ...] | None = None,
        on_dlpack: Callable[[Any], None] | None = None,
        ndim: int | None = None,
    ) -> None:
        self.ndim = ndim  # what the capsule claims (None: len(shape)), to test bad ones
        self.ptr, self.shape, self.dtype, self.device = ptr, shape, dtype, device
        self.keep, self.versioned, self.readonly, self.strides = keep, versioned, readonly, strides
        self.on_dlpack = on_dlpack
        self.streams: list[Any] = []
        self.max_versions: list[Any] = []
        self.deleted = 0
        self.capsules: list[Any] = []  # the last capsule handed out (to read its name)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, **_: Any) -> Any:
        self.streams.append(stream)
        self.max_versions.append(max_version)
        if self.on_dlpack is not None:
            self.on_dlpack(stream)
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        strides = None
        if self.strides is not None:
            strides = (ctypes.c_int64 * max(ndim, 1))(*self.strides)
        versioned = self.versioned and max_version is not None and max_version[0] >= 1
        managed: Any = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        dl = managed.dl_tensor
        dl.data = self.ptr or None
        dl.device = DLDevice(*self.device)
        dl.ndim = ndim if self.ndim is None else self.ndim
        dl.dtype = DLDataType(*self.dtype)
        dl.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        if strides is not None:
            dl.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        dl.byte_offset = 0
        addr = ctypes.addressof(managed)
        if versioned:
            managed.version = DLPackVersion(1, 1)
            managed.flags = 1 if self.readonly else 0
            managed.deleter = _DELETER_V
        else:
            managed.deleter = _DELETER
        name = b"dltensor_versioned" if versioned else b"dltensor"
        with _handed_lock:
            _handed_out[addr] = (self, (managed, shape, strides))
        capsule = _capsule_new(addr, name, _DESTRUCTOR)
        self.capsules[:] = [capsule]
        return capsule


class CAIOnly:
    """Exposes memory through ``__cuda_array_interface__`` (v3) only."""

    def __init__(
        self,
        ptr: int,
        shape: tuple[int, ...],
        typestr: str,
        *,
        readonly: bool = False,
        stream: int | None = None,
        strides: tuple[int, ...] | None = None,
        keep: Any = None,
    ) -> None:
        self.keep = keep
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, readonly),
            "strides": strides,
            "descr": [("", typestr)],
            "stream": stream,
        }


# -- helpers ---------------------------------------------------------------------------------
@pytest.fixture
async def sim_env(make_env: MakeEnv) -> tuple[aioep.Environment, aioep.EpDevice]:
    """An environment with the sim (closed after the test's locals are gone) and device 0."""
    env = await make_env()
    return env, env.ep_devices(ep_name="SimExecutionProvider")[0]


def sim_mem(dev: aioep.EpDevice) -> aioep.MemoryInfo:
    info = dev.memory_info(MemoryType.DEFAULT)
    assert info is not None
    return info


@contextlib.contextmanager
def gated(stream: aioep.SyncStream) -> Iterator[threading.Event]:
    """Hold a sim stream's worker ("the device") until the returned event is set."""
    gate = threading.Event()
    stream.impl.enqueue(lambda: gate.wait(30))  # type: ignore[attr-defined]
    try:
        yield gate
    finally:
        gate.set()


async def sim_tensor_with(
    env: aioep.Environment, dev: aioep.EpDevice, data: np.ndarray[Any, Any]
) -> aioep.Tensor:
    t = env.empty(data.shape, data.dtype, sim_mem(dev))
    await env.copy_tensors([data], [t])
    return t


async def read_back(env: aioep.Environment, t: aioep.Tensor) -> np.ndarray[Any, Any]:
    out = np.empty(t.shape, t.dtype)
    await env.copy_tensors([t], [out])
    return out


# -- host memory -----------------------------------------------------------------------------
async def test_dlpack_only_host_arrays_both_ways() -> None:
    async with aioep.Environment(autoload=False):
        src = np.arange(24, dtype=np.int32).reshape(4, 6)
        dst = np.zeros_like(src)
        wsrc, wdst = DLPackOnly(src), DLPackOnly(dst)
        (out,) = await aioep.copy_tensors([wsrc], [wdst])
        np.testing.assert_array_equal(dst, src)
        assert out.data_ptr == dst.ctypes.data  # zero-copy: the producer's own memory
        assert out.buffer.imported
        assert out.buffer.producer is wdst
        # Host memory takes no stream: the producer is asked with stream None.
        assert [c.get("stream") for c in wsrc.calls + wdst.calls] == [None, None]


async def test_host_producer_gets_stream_none_even_on_a_stream(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, sim = sim_env
    src = np.arange(256, dtype=np.float32)
    wsrc = DLPackOnly(src)
    t = env.empty(src.shape, src.dtype, sim_mem(sim))
    async with env.create_sync_stream(sim) as stream:
        await env.copy_tensors([wsrc], [t], stream)
        await stream
    assert [c.get("stream") for c in wsrc.calls] == [None]
    np.testing.assert_array_equal(await read_back(env, t), src)


async def test_read_only_host_import_is_refused_as_destination() -> None:
    async with aioep.Environment(autoload=False):
        ro = np.zeros(8, np.uint8)
        ro.flags.writeable = False
        src = np.arange(8, dtype=np.uint8)
        with pytest.raises(InvalidArgument, match=r"destination 0: DLPackOnly " + _READ_ONLY):
            aioep.copy_tensors([src], [DLPackOnly(ro)])
        # As a source it is fine.
        out = np.zeros(8, np.uint8)
        await aioep.copy_tensors([DLPackOnly(np.arange(8, dtype=np.uint8)[::-1].copy())], [out])
        np.testing.assert_array_equal(out, np.arange(8)[::-1])


async def test_strided_host_source_is_copied_right_and_destination_refused(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, sim = sim_env
    base = np.arange(48, dtype=np.float64).reshape(6, 8)
    view = base[::2, 1::3]  # strided: packed by the copy
    t = env.empty(view.shape, view.dtype, sim_mem(sim))
    await env.copy_tensors([DLPackOnly(view)], [t])
    np.testing.assert_array_equal(await read_back(env, t), view)
    with pytest.raises(
        InvalidArgument, match=r"destination 0: destination DLPackOnly .* not C-contiguous"
    ):
        env.copy_tensors([np.zeros(view.shape)], [DLPackOnly(base[::2, 1::3])])


async def test_unowned_device_and_bad_producers_are_invalid_argument(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, _sim = sim_env
    dst = np.zeros(4, np.float32)
    rocm = CapsuleProducer(0x1000, (4,), (2, 32, 1), (KDL_ROCM, 0))
    with pytest.raises(
        InvalidArgument,
        match=r"source 0: CapsuleProducer lives on kDLRocm device 0, which no registered backend owns",
    ):
        env.copy_tensors([rocm], [dst])
    # A sim device id that does not exist, and an address outside any sim allocation.
    with pytest.raises(InvalidArgument, match=r"source 0: .* owned by no registered device"):
        env.copy_tensors([CapsuleProducer(0x1000, (4,), (2, 32, 1), (KDL_EXT_DEV, 7))], [dst])
    bogus = CapsuleProducer(0x1000, (4,), (2, 32, 1), (KDL_EXT_DEV, 0))
    with pytest.raises(InvalidArgument, match="owned by no registered device"):
        env.copy_tensors([bogus], [dst])
    assert bogus.deleted == 1  # refused, and handed back to its producer
    # CUDA Array Interface over plain host memory: no registered device owns it.
    host = np.zeros(4, np.float32)
    with pytest.raises(
        InvalidArgument,
        match=r"destination 0: CAIOnly.__cuda_array_interface__: 16 bytes at .* no registered device owns",
    ):
        env.copy_tensors([dst], [CAIOnly(host.ctypes.data, (4,), "<f4", keep=host)])
    # Not a tensor at all.
    with pytest.raises(
        InvalidArgument, match=r"source 0: expected an aioep.Tensor or numpy.ndarray"
    ):
        env.copy_tensors([object()], [dst])


async def test_unsupported_dtype_and_layout_name_the_argument(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, sim = sim_env
    t = await sim_tensor_with(env, sim, np.arange(8, dtype=np.uint16))
    out = np.zeros(8, np.uint16)
    bf16 = CapsuleProducer(t.data_ptr, (8,), (4, 16, 1), (KDL_EXT_DEV, 0))  # kDLBfloat
    with pytest.raises(
        InvalidArgument,
        match=r"source 0: CapsuleProducer.__dlpack__ gave a capsule aioep cannot use: .*no numpy",
    ):
        env.copy_tensors([bf16], [out])
    assert bf16.deleted == 1
    strided = CapsuleProducer(t.data_ptr, (4,), (1, 16, 1), (KDL_EXT_DEV, 0), strides=(2,))
    with pytest.raises(
        InvalidArgument, match=r"source 0: CapsuleProducer of shape \(4,\) has strides \(2,\)"
    ):
        env.copy_tensors([strided], [np.zeros(4, np.uint16)])
    assert strided.deleted == 1
    cai = CAIOnly(t.data_ptr, (4,), "<u2", strides=(4,))
    with pytest.raises(
        InvalidArgument,
        match=r"destination 0: CAIOnly.__cuda_array_interface__: .* not C-contiguous",
    ):
        env.copy_tensors([np.zeros(4, np.uint16)], [cai])
    with pytest.raises(InvalidArgument, match="unsupported dtype"):
        env.copy_tensors([CAIOnly(t.data_ptr, (2,), "<M8[s]")], [np.zeros(2, "M8[s]")])
    # Size-1 dims may carry any stride: still contiguous.
    ok = CapsuleProducer(t.data_ptr, (1, 8), (1, 16, 1), (KDL_EXT_DEV, 0), strides=(99, 1))
    res = np.zeros((1, 8), np.uint16)
    await env.copy_tensors([ok], [res])
    np.testing.assert_array_equal(res[0], np.arange(8))


async def test_imported_host_memory_is_usable_by_any_environment() -> None:
    """Imported memory belongs to its producer, not to the environment that wrapped it."""
    src = np.arange(16, dtype=np.float32)
    async with aioep.Environment(autoload=False) as first:
        (imported,) = await first.copy_tensors([np.zeros(16, np.float32)], [DLPackOnly(src)])
    assert imported.buffer.imported
    np.testing.assert_array_equal(src, 0)
    async with aioep.Environment(autoload=False) as second:
        await second.copy_tensors([np.full(16, 3, np.float32)], [imported])
        out = np.zeros(16, np.float32)
        await second.copy_tensors([imported], [out])
    np.testing.assert_array_equal(src, 3)
    np.testing.assert_array_equal(out, 3)
    imported.buffer._pin()  # as a copy in flight does
    with pytest.raises(aioep.InUseError):
        imported.buffer.free()
    imported.buffer._unpin()
    imported.buffer.free()  # hands the memory back to its producer; src itself stays valid
    assert imported.buffer.freed
    np.testing.assert_array_equal(src, 3)


# -- sim memory: DLPack ----------------------------------------------------------------------
@pytest.mark.parametrize("versioned", [True, False])
async def test_sim_dlpack_in_and_out(
    sim_env: tuple[aioep.Environment, aioep.EpDevice], versioned: bool
) -> None:
    env, sim = sim_env
    data = np.arange(64, dtype=np.float32).reshape(8, 8)
    t = await sim_tensor_with(env, sim, data)
    prod = CapsuleProducer(
        t.data_ptr, (8, 8), (2, 32, 1), (KDL_EXT_DEV, 0), keep=t, versioned=versioned
    )
    out = np.zeros_like(data)
    (res,) = await env.copy_tensors([prod], [out])
    np.testing.assert_array_equal(out, data)
    assert prod.max_versions == [(1, 1)]
    used = b"used_dltensor_versioned" if versioned else b"used_dltensor"
    assert _capsule_name(prod.capsules[0]) == used  # consumed per protocol
    # Into the producer's memory:
    src = np.full((8, 8), 7, np.float32)
    await env.copy_tensors([src], [prod])
    np.testing.assert_array_equal(await read_back(env, t), src)
    # Every consumed capsule goes back through its deleter once the tensors are gone.
    del res
    gc.collect()
    assert prod.deleted == 2
    prod.capsules.clear()


async def test_sim_dlpack_read_only_flag(sim_env: tuple[aioep.Environment, aioep.EpDevice]) -> None:
    env, sim = sim_env
    t = await sim_tensor_with(env, sim, np.arange(16, dtype=np.int64))
    ro = CapsuleProducer(t.data_ptr, (16,), (0, 64, 1), (KDL_EXT_DEV, 0), readonly=True)
    with pytest.raises(InvalidArgument, match=r"destination 0: CapsuleProducer is read-only"):
        env.copy_tensors([np.zeros(16, np.int64)], [ro])
    assert ro.deleted == 1
    out = np.zeros(16, np.int64)
    await env.copy_tensors([ro], [out])
    np.testing.assert_array_equal(out, np.arange(16))


async def test_sim_dlpack_stream_handshake(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, sim = sim_env
    data = np.arange(32, dtype=np.int16)
    t = await sim_tensor_with(env, sim, data)
    prod = CapsuleProducer(t.data_ptr, (32,), (0, 16, 1), (KDL_EXT_DEV, 0))
    out = np.zeros_like(data)
    async with env.create_sync_stream(sim) as stream:
        await env.copy_tensors([prod], [out], stream)
        await stream
        assert prod.streams == [stream.handle]  # the consumer's stream
    await env.copy_tensors([prod], [out])
    assert prod.streams[1] is None  # no stream: the producer must make the data ready
    np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("allocated_on_stream", [True, False])
async def test_sim_export_orders_the_consumer_stream_after_the_tensor_stream(
    sim_env: tuple[aioep.Environment, aioep.EpDevice], allocated_on_stream: bool
) -> None:
    """Tensor.__dlpack__(stream=consumer) makes the consumer wait for the work on the tensor's
    stream and the copies pending on it (here: aioep itself is the consumer, through a
    DLPack-only wrapper)."""
    env, sim = sim_env
    data = np.arange(1024, dtype=np.float32)
    async with env.create_sync_stream(sim) as producer, env.create_sync_stream(sim) as consumer:
        t = env.empty(
            data.shape, data.dtype, sim_mem(sim), stream=producer if allocated_on_stream else None
        )
        with gated(producer) as gate:
            upload = env.copy_tensors([data], [t], producer)  # held behind the gate
            wrapper = DLPackOnly(t)
            out = np.zeros_like(data)
            future = env.copy_tensors([wrapper], [out], consumer)
            assert wrapper.calls[0]["stream"] == consumer.handle
            assert not future.done()  # the consumer waits for the producer's stream
            gate.set()
            await future
            await upload
        np.testing.assert_array_equal(out, data)
        assert t.__dlpack_device__() == (KDL_EXT_DEV, 0)


# -- sim memory: CUDA Array Interface ---------------------------------------------------------
@pytest.mark.parametrize("consumer_stream", [False, True])
async def test_sim_cai_stream_is_waited_on(
    sim_env: tuple[aioep.Environment, aioep.EpDevice], consumer_stream: bool
) -> None:
    env, sim = sim_env
    data = np.arange(4096, dtype=np.uint8)
    t = env.empty(data.shape, data.dtype, sim_mem(sim))
    await env.copy_tensors([np.zeros_like(data)], [t])
    async with env.create_sync_stream(sim) as producer, env.create_sync_stream(sim) as mine:
        with gated(producer) as gate:
            upload = env.copy_tensors([data], [t], producer)  # pending behind the gate
            cai = CAIOnly(t.data_ptr, data.shape, "|u1", stream=producer.handle, keep=t)
            out = np.zeros_like(data)
            future = env.copy_tensors([cai], [out], mine if consumer_stream else None)
            assert not future.done()  # waiting for the producer's stream, not racing it
            gate.set()
            await future
            await upload
        np.testing.assert_array_equal(out, data)


async def test_sim_cai_read_only_and_bad_stream(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, sim = sim_env
    t = await sim_tensor_with(env, sim, np.arange(4, dtype=np.float32))
    with pytest.raises(InvalidArgument, match=r"destination 0: .*read-only \(data\[1\] is True\)"):
        env.copy_tensors(
            [np.zeros(4, np.float32)], [CAIOnly(t.data_ptr, (4,), "<f4", readonly=True)]
        )
    with pytest.raises(InvalidArgument, match="stream 0 is disallowed"):
        env.copy_tensors([CAIOnly(t.data_ptr, (4,), "<f4", stream=0)], [np.zeros(4, np.float32)])
    with pytest.raises(InvalidArgument, match="not an open sim stream"):
        env.copy_tensors(
            [CAIOnly(t.data_ptr, (4,), "<f4", stream=12345)], [np.zeros(4, np.float32)]
        )
    out = np.zeros(4, np.float32)
    await env.copy_tensors([CAIOnly(t.data_ptr, (4,), "<f4", readonly=True)], [out])
    np.testing.assert_array_equal(out, np.arange(4))


# -- ownership: aioep memory that comes back wrapped -----------------------------------------
async def _filled(env: aioep.Environment, value: float) -> aioep.Tensor:
    dev = env.ep_devices(ep_name="SimExecutionProvider")[0]
    return await sim_tensor_with(env, dev, np.full(16, value, np.float32))


async def test_another_environments_tensor_is_refused_when_wrapped(make_env: MakeEnv) -> None:
    """Environment A's sim tensor handed to environment B in a DLPack or CUDA Array Interface
    wrapper is refused like the tensor itself: B neither reads it nor writes it, and nothing
    of B's own memory is read or overwritten in its place."""
    a, b = await make_env(), await make_env()
    ta, tb = await _filled(a, 1.0), await _filled(b, 2.0)
    exports = aioep.abc.live_dlpack_exports()
    theirs = r"is device memory of another environment \(library 'sim' of Environment #\d+\)"
    wrappers: list[tuple[Callable[[], Any], str]] = [
        # aioep's own capsule, passed on by another object:
        (lambda: DLPackOnly(ta), theirs),
        # another library's capsule over memory aioep exported (just above):
        (lambda: CapsuleProducer(ta.data_ptr, (16,), (2, 32, 1), (KDL_EXT_DEV, 0)), theirs),
        # a bare address: sim addresses are unique in the process, none of B's memory is there
        (lambda: CAIOnly(ta.data_ptr, (16,), "<f4", keep=ta), "no registered device owns"),
    ]
    for wrap, refusal in wrappers:
        with pytest.raises(InvalidArgument, match=rf"destination 0: .*{refusal}"):
            b.copy_tensors([np.full(16, 9.0, np.float32)], [wrap()])
        out = np.zeros(16, np.float32)
        with pytest.raises(InvalidArgument, match=rf"source 0: .*{refusal}"):
            b.copy_tensors([wrap()], [out])
        np.testing.assert_array_equal(out, 0)
    gc.collect()
    assert aioep.abc.live_dlpack_exports() == exports  # every refused export handed back
    np.testing.assert_array_equal(await read_back(a, ta), 1.0)
    np.testing.assert_array_equal(await read_back(b, tb), 2.0)
    # In its own environment the wrapped tensor is that tensor.
    (res,) = await a.copy_tensors([np.full(16, 3.0, np.float32)], [DLPackOnly(ta)])
    assert res.buffer is ta.buffer
    np.testing.assert_array_equal(await read_back(a, ta), 3.0)
    del res


async def test_memory_handed_out_is_recognised_inside_any_wrapper(make_env: MakeEnv) -> None:
    """Once aioep exported a tensor, a capsule that another library makes over that memory
    (PyTorch's view of an aioep export, say) is that tensor's memory: the owner's rule
    applies to it, in a copy, a session run and an IOBinding, at its offset."""
    a, b = await make_env(), await make_env()
    ta = await _filled(a, 1.0)
    ta.__dlpack__()  # exported (the capsule, unconsumed, is released at once)
    tail = CapsuleProducer(ta.data_ptr + 32, (8,), (2, 32, 1), (KDL_EXT_DEV, 0))
    with pytest.raises(InvalidArgument, match=r"another environment \(library 'sim' of Env"):
        b.copy_tensors([np.zeros(8, np.float32)], [tail])
    (res,) = await a.copy_tensors([np.full(8, 5.0, np.float32)], [tail])
    assert res.buffer is ta.buffer
    assert res.byte_offset == 32
    np.testing.assert_array_equal(await read_back(a, ta), [1.0] * 8 + [5.0] * 8)
    assert tail.deleted == 2  # taken as aioep's buffer: the producer's capsules went back
    del res


async def test_closed_environments_tensor_is_closed_error_when_wrapped(
    make_env: MakeEnv,
) -> None:
    a = await make_env()
    old = await _filled(a, 1.0)
    await a.aclose()
    assert a.close_report is not None
    assert a.close_report.live_buffers, a.close_report
    b = await make_env()
    with pytest.raises(aioep.ClosedError, match=r"destination 0: .* which is closed"):
        b.copy_tensors([np.zeros(16, np.float32)], [DLPackOnly(old)])
    del old


async def test_session_and_io_binding_refuse_another_environments_wrapped_tensor(
    make_env: MakeEnv,
) -> None:
    pytest.importorskip("onnx")
    from _models import chain

    a, b = await make_env(), await make_env()
    ta = await sim_tensor_with(
        a, a.ep_devices(ep_name="SimExecutionProvider")[0], np.ones((3, 4), np.float32)
    )
    sim_b = b.ep_devices(ep_name="SimExecutionProvider")[0]
    async with await b.create_session(chain(), [sim_b]) as sess:
        with pytest.raises(InvalidArgument, match=r"run: input 'x': .*another environment"):
            await sess.run({"x": DLPackOnly(ta)})
        binding = sess.io_binding()
        for name, bind in (("x", binding.bind_input), ("y", binding.bind_output)):
            with pytest.raises(InvalidArgument, match=rf"{name}.*another environment"):
                bind(name, DLPackOnly(ta))
        del binding, bind
    del ta


# -- bad input: EpError naming the argument, the producer's capsule handed back ----------------
@pytest.mark.parametrize(
    ("case", "kwargs", "refusal"),
    [
        ("negative dimension", {"shape": (-4,)}, r"shape \(-4,\); dimensions must be >= 0"),
        ("null data", {"ptr": 0}, "null data pointer"),
        ("ndim -1", {"ndim": -1}, "ndim -1; expected 0 to 64"),
        ("ndim 65", {"ndim": 65}, "ndim 65; expected 0 to 64"),
        ("bfloat16", {"dtype": (4, 16, 1)}, "no numpy dtype"),
        pytest.param(
            "float128",
            {"dtype": (2, 128, 1)},
            "no numpy dtype .*long double is not IEEE",
            marks=pytest.mark.skipif(_BINARY128, reason="long double is IEEE binary128 here"),
        ),
        pytest.param(
            "complex256",
            {"dtype": (5, 256, 1)},
            "no numpy dtype",
            marks=pytest.mark.skipif(_BINARY128, reason="long double is IEEE binary128 here"),
        ),
    ],
)
@pytest.mark.parametrize("versioned", [True, False])
async def test_refused_device_capsule_is_handed_back_and_the_argument_named(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
    case: str,
    kwargs: dict[str, Any],
    refusal: str,
    versioned: bool,
) -> None:
    """Once read, a capsule is aioep's: a refusal calls the producer's deleter (DLPack's rule
    for a consumer) and the message names the argument, never ``Buffer``."""
    env, sim = sim_env
    t = await sim_tensor_with(env, sim, np.arange(4, dtype=np.float32))
    args: dict[str, Any] = {"ptr": t.data_ptr, "shape": (4,), "dtype": (2, 32, 1)}
    args.update(kwargs)
    prod = CapsuleProducer(
        args.pop("ptr"), args.pop("shape"), args.pop("dtype"), (KDL_EXT_DEV, 0),
        versioned=versioned, **args,
    )  # fmt: skip
    with pytest.raises(
        InvalidArgument, match=rf"^copy_tensors source 0: CapsuleProducer.*{refusal}"
    ):
        env.copy_tensors([prod], [np.zeros(4, np.float32)])
    assert prod.deleted == 1, case
    assert _capsule_name(prod.capsules[0]).startswith(b"used_")  # consumed, then handed back
    prod.capsules.clear()
    np.testing.assert_array_equal(await read_back(env, t), np.arange(4))


@pytest.mark.parametrize(
    ("field", "value", "refusal"),
    [
        ("strides", 5, r"strides must be None or a tuple of 1 int\(s\).*got int 5"),
        ("strides", (4.0,), r"strides must be None or a tuple of 1 int\(s\)"),
        ("stream", "abc", r"stream must be None or an int .*got str 'abc'"),
        ("stream", 1.5, r"stream must be None or an int"),
        ("shape", (15.9,), r"shape must be a tuple of ints >= 0, got tuple \(15.9,\)"),
        ("shape", (-1,), r"shape must be a tuple of ints >= 0"),
        ("shape", 4, r"shape must be a tuple of ints >= 0, got int 4"),
        ("typestr", 7, r"typestr must be a numpy type string, got int 7"),
        pytest.param(
            "typestr",
            "<f16",
            r"unsupported dtype float128 \('<f16'\)",
            marks=pytest.mark.skipif(_BINARY128, reason="long double is IEEE binary128 here"),
        ),
        ("data", ("0x1000", False), r"data must be a tuple \(pointer: int, read_only: bool\)"),
        ("data", 4096, r"data must be a tuple"),
        ("version", "3", r"version must be an int, got str '3'"),
    ],
)
async def test_malformed_cuda_array_interface_is_invalid_argument(
    sim_env: tuple[aioep.Environment, aioep.EpDevice], field: str, value: Any, refusal: str
) -> None:
    env, sim = sim_env
    t = await sim_tensor_with(env, sim, np.arange(4, dtype=np.float32))
    cai = CAIOnly(t.data_ptr, (4,), "<f4", keep=t)
    cai.__cuda_array_interface__[field] = value
    out = np.zeros(4, np.float32)
    with pytest.raises(InvalidArgument, match=rf"^copy_tensors source 0: CAIOnly.*{refusal}"):
        env.copy_tensors([cai], [out])
    with pytest.raises(InvalidArgument, match=rf"^copy_tensors destination 0: CAIOnly.*{refusal}"):
        env.copy_tensors([np.ones(4, np.float32)], [cai])
    np.testing.assert_array_equal(await read_back(env, t), np.arange(4))


async def test_cuda_array_interface_that_raises_is_invalid_argument_with_its_cause(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, _sim = sim_env
    failure = KeyError("not ready")

    class Broken:
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            raise failure

    with pytest.raises(
        InvalidArgument, match=r"source 0: Broken.__cuda_array_interface__ raised KeyError"
    ) as caught:
        env.copy_tensors([Broken()], [np.zeros(4, np.float32)])
    assert caught.value.__cause__ is failure


async def test_legacy_host_capsule_is_a_writable_destination() -> None:
    """A legacy (pre-1.0) capsule has no read-only flag: aioep writes into it, as PyTorch and
    CuPy do (numpy >= 2 marks such an import read-only); a DLPack 1.x producer's read-only
    flag is honoured."""
    async with aioep.Environment(autoload=False):
        dst = np.zeros(8, np.int32)
        legacy = CapsuleProducer(dst.ctypes.data, (8,), (0, 32, 1), (KDL_CPU, 0), keep=dst,
                                 versioned=False)  # fmt: skip
        (res,) = await aioep.copy_tensors([np.arange(8, dtype=np.int32)], [legacy])
        np.testing.assert_array_equal(dst, np.arange(8))
        assert res.data_ptr == dst.ctypes.data  # zero-copy, into the producer's memory
        flagged = CapsuleProducer(dst.ctypes.data, (8,), (0, 32, 1), (KDL_CPU, 0), keep=dst,
                                  readonly=True)  # fmt: skip
        with pytest.raises(InvalidArgument, match=r"destination 0: CapsuleProducer is read-only"):
            aioep.copy_tensors([np.zeros(8, np.int32)], [flagged])
        np.testing.assert_array_equal(dst, np.arange(8))
        del res
        gc.collect()
        assert legacy.deleted == 1
        assert flagged.deleted == 1


# -- lifetime --------------------------------------------------------------------------------
async def test_dropped_producer_lives_until_the_copy_is_done(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, sim = sim_env
    data = np.arange(2048, dtype=np.int32)
    t = env.empty(data.shape, data.dtype, sim_mem(sim))
    async with env.create_sync_stream(sim) as stream:
        with gated(stream) as gate:
            src = data.copy()
            producer = DLPackOnly(src)
            alive = weakref.ref(producer)
            src_alive = weakref.ref(producer.inner)
            future = env.copy_tensors([producer], [t], stream)
            del producer, src
            gc.collect()
            assert alive() is not None
            assert src_alive() is not None
            gate.set()
            await future
        await stream
        del future
        gc.collect()
        assert alive() is None
        assert src_alive() is None
    np.testing.assert_array_equal(await read_back(env, t), data)


async def test_cancelled_await_keeps_the_producer_until_the_device_is_done(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, sim = sim_env
    data = np.arange(512, dtype=np.float32)
    t = await sim_tensor_with(env, sim, data)
    async with env.create_sync_stream(sim) as stream:
        with gated(stream) as gate:
            prod = CapsuleProducer(t.data_ptr, data.shape, (2, 32, 1), (KDL_EXT_DEV, 0))
            out = np.zeros_like(data)
            with anyio.move_on_after(0.01) as scope:
                await env.copy_tensors([prod], [out], stream)
            assert scope.cancelled_caught
            weak = weakref.ref(prod)
            deleted_before = prod.deleted
            del prod
            gc.collect()
            assert weak() is not None
            assert deleted_before == 0
            gate.set()
        await stream
        gc.collect()
        assert weak() is None  # freed after the device finished with it
    np.testing.assert_array_equal(out, data)


# -- sessions and IOBinding ------------------------------------------------------------------
async def test_session_run_and_io_binding_take_foreign_tensors(
    sim_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    pytest.importorskip("onnx")
    from _models import chain, reference

    env, sim = sim_env
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    want = reference(chain(), {"x": x})
    async with await env.create_session(chain(), [sim]) as sess:
        outs = await sess.run({"x": DLPackOnly(x)}, output_location="host")
        np.testing.assert_allclose(outs["y"].numpy(), want["y"], rtol=1e-5, atol=1e-6)
        x_dev = await sim_tensor_with(env, sim, x)
        outs = await sess.run(
            {"x": CAIOnly(x_dev.data_ptr, (3, 4), "<f4", keep=x_dev)}, output_location="host"
        )
        np.testing.assert_allclose(outs["y"].numpy(), want["y"], rtol=1e-5, atol=1e-6)
        with pytest.raises(InvalidArgument, match=r"run: input 'x': .*no registered backend owns"):
            await sess.run({"x": CapsuleProducer(1, (3, 4), (2, 32, 1), (KDL_ROCM, 0))})

        binding = sess.io_binding()
        y = np.zeros((3, 4), np.float32)
        binding.bind_input("x", DLPackOnly(x))
        binding.bind_output("y", DLPackOnly(y))
        await sess.run_with_binding(binding)
        np.testing.assert_allclose(y, want["y"], rtol=1e-5, atol=1e-6)
        ro = np.zeros((3, 4), np.float32)
        ro.flags.writeable = False
        with pytest.raises(InvalidArgument, match=r"bind_output\('y'\): DLPackOnly " + _READ_ONLY):
            binding.bind_output("y", DLPackOnly(ro))
        assert binding.outputs["y"].data_ptr == y.ctypes.data  # unchanged
        # A bound CAI whose producer stream has pending work: the run waits for it.
        async with env.create_sync_stream(sim) as producer:
            x2 = x * 2
            with gated(producer) as gate:
                upload = env.copy_tensors([x2], [x_dev], producer)
                binding.bind_input(
                    "x", CAIOnly(x_dev.data_ptr, (3, 4), "<f4", stream=producer.handle)
                )
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sess.run_with_binding, binding)
                    for _ in range(20):  # give a run that did not wait the chance to race
                        await anyio.lowlevel.checkpoint()
                    gate.set()
                await upload
        np.testing.assert_allclose(y, reference(chain(), {"x": x2})["y"], rtol=1e-5, atol=1e-6)
        del binding, outs, x_dev


# -- (emulated) CUDA memory ------------------------------------------------------------------
# As in test_cuda.py: the real driver where cuInit finds a GPU, else the emulated driver (a
# test double), with the same assertions; skipped only where neither exists.
from cuda_emulator import select_driver  # noqa: E402

DRIVER = select_driver()
needs_gpu = pytest.mark.skipif(not DRIVER.available, reason=DRIVER.reason or "")


@contextlib.asynccontextmanager
async def cuda_environments(count: int) -> AsyncIterator[list[tuple[aioep.Environment, Any]]]:
    """``count`` environments with the CUDA backend (on the emulator: one device they share),
    each with its first EP device; closed afterwards, and the emulator saw no misuse."""
    pytest.importorskip("aioep_cuda")
    emulator = DRIVER.emulator
    with contextlib.ExitStack() as stack:
        if emulator is not None:
            emulator.take_violation()
            stack.enter_context(emulator.devices(1))
        envs: list[aioep.Environment] = []
        try:
            for _ in range(count):
                envs.append(await aioep.Environment(autoload=False).__aenter__())
                envs[-1].register_library("cuda", "aioep_cuda:CudaFactory")
            yield [(env, env.ep_devices(ep_name="CUDAExecutionProvider")[0]) for env in envs]
            gc.collect()
        finally:
            for env in reversed(envs):
                await env.aclose()
        if emulator is not None:
            violation = emulator.take_violation()
            assert violation is None, f"the CUDA emulator saw a violation: {violation}"


@pytest.fixture
async def cuda_env() -> AsyncIterator[tuple[aioep.Environment, aioep.EpDevice]]:
    async with cuda_environments(1) as [pair]:
        yield pair


async def not_before_release(future: aioep.CopyFuture) -> None:
    """Assert that ``future`` does not complete while the producer's stream is held: a copy
    ordered after it cannot complete at all, one that is not completes within moments (the
    bound only limits how long a broken ordering takes to show)."""
    with anyio.move_on_after(0.5):
        await future
    assert not future.done(), "the copy did not wait for the producer's stream"


def cuda_mem(gpu: aioep.EpDevice, kind: MemoryType = MemoryType.DEFAULT) -> aioep.MemoryInfo:
    info = gpu.memory_info(kind)
    assert info is not None
    return info


@pytest.mark.gpu
@needs_gpu
async def test_cuda_dlpack_stream_handshake_and_values(
    cuda_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, gpu = cuda_env
    data = np.arange(1 << 12, dtype=np.float32)
    t = env.empty(data.shape, data.dtype, cuda_mem(gpu))
    await env.copy_tensors([data], [t])
    prod = CapsuleProducer(t.data_ptr, data.shape, (2, 32, 1), (KDL_CUDA, 0), keep=t)
    out = np.zeros_like(data)
    async with env.create_sync_stream(gpu) as stream:
        (imported,) = await env.copy_tensors([out], [prod], stream)  # into the producer
        await env.copy_tensors([prod], [out], stream)
        await stream
        assert prod.streams == [stream.handle, stream.handle]  # the consumer's CUstream
        assert imported.memory_info == cuda_mem(gpu)
        assert imported.buffer.imported
    np.testing.assert_array_equal(out, 0)
    await env.copy_tensors([data], [prod])
    await env.copy_tensors([prod], [out])
    assert prod.streams[2:] == [None, None]  # no stream: the legacy default stream
    np.testing.assert_array_equal(out, data)
    del imported
    gc.collect()
    assert prod.deleted == 4
    with pytest.raises(InvalidArgument, match="owned by no registered device"):
        env.copy_tensors(
            [CapsuleProducer(t.data_ptr, data.shape, (2, 32, 1), (KDL_CUDA, 3))], [out]
        )
    del t


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("consumer_stream", [False, True])
async def test_cuda_cai_stream_is_waited_on(
    cuda_env: tuple[aioep.Environment, aioep.EpDevice], consumer_stream: bool
) -> None:
    from _cuda_hold import hold_stream

    env, gpu = cuda_env
    data = np.arange(1 << 14, dtype=np.uint8)
    t = env.empty(data.shape, data.dtype, cuda_mem(gpu))
    await env.copy_tensors([np.zeros_like(data)], [t])
    pinned = env.empty(data.shape, data.dtype, cuda_mem(gpu, MemoryType.HOST_ACCESSIBLE))
    pinned.numpy()[:] = data
    async with env.create_sync_stream(gpu) as producer, env.create_sync_stream(gpu) as mine:
        with hold_stream(producer) as release:
            upload = env.copy_tensors([pinned], [t], producer)  # held on the device
            cai = CAIOnly(t.data_ptr, data.shape, "|u1", stream=producer.handle, keep=t)
            out = np.zeros_like(data)
            future = env.copy_tensors([cai], [out], mine if consumer_stream else None)
            await not_before_release(future)  # ordered after the producer's stream
            release()
            await future
            await upload
        np.testing.assert_array_equal(out, data)
    del t, pinned, upload, future, cai


@pytest.mark.gpu
@needs_gpu
async def test_cuda_cai_over_pinned_and_pageable_host_memory(
    cuda_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    env, gpu = cuda_env
    data = np.arange(256, dtype=np.int32)
    pinned = env.empty(data.shape, data.dtype, cuda_mem(gpu, MemoryType.HOST_ACCESSIBLE))
    pinned.numpy()[:] = data
    dev = env.empty(data.shape, data.dtype, cuda_mem(gpu))
    cai = CAIOnly(pinned.data_ptr, data.shape, "<i4", keep=pinned)
    (res,) = await env.copy_tensors([cai], [dev])
    out = np.zeros_like(data)
    await env.copy_tensors([dev], [out])
    np.testing.assert_array_equal(out, data)
    # Page-locked host memory is the CUDA device's pinned memory; pageable memory no one owns.
    imported = aioep.copy_tensors([CAIOnly(pinned.data_ptr, data.shape, "<i4")], [dev])
    await imported
    host = np.zeros_like(data)
    with pytest.raises(InvalidArgument, match="no registered device owns"):
        env.copy_tensors([CAIOnly(host.ctypes.data, data.shape, "<i4", keep=host)], [dev])
    del pinned, dev, res, imported


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("allocated_on_stream", [True, False])
async def test_cuda_export_orders_the_consumer_after_the_tensor_stream(
    cuda_env: tuple[aioep.Environment, aioep.EpDevice], allocated_on_stream: bool
) -> None:
    from _cuda_hold import hold_stream

    env, gpu = cuda_env
    data = np.arange(4096, dtype=np.float32)
    pinned = env.empty(data.shape, data.dtype, cuda_mem(gpu, MemoryType.HOST_ACCESSIBLE))
    pinned.numpy()[:] = data
    async with env.create_sync_stream(gpu) as producer, env.create_sync_stream(gpu) as consumer:
        t = env.empty(
            data.shape, data.dtype, cuda_mem(gpu), stream=producer if allocated_on_stream else None
        )
        with hold_stream(producer) as release:
            upload = env.copy_tensors([pinned], [t], producer)
            wrapper = DLPackOnly(t)  # aioep's own export, taken back through DLPack only
            out = np.zeros_like(data)
            future = env.copy_tensors([wrapper], [out], consumer)
            assert wrapper.calls[0]["stream"] == consumer.handle
            await not_before_release(future)
            release()
            await future
            await upload
        np.testing.assert_array_equal(out, data)
    del t, pinned, upload, future, wrapper


@pytest.mark.gpu
@needs_gpu
async def test_cuda_array_interface_export_names_the_pending_copy_stream(
    cuda_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    """A tensor's ``__cuda_array_interface__`` names the stream of the copy still using it,
    and aioep, as the consumer of that interface, waits for it."""
    from _cuda_hold import hold_stream

    env, gpu = cuda_env
    data = np.arange(2048, dtype=np.int64)
    pinned = env.empty(data.shape, data.dtype, cuda_mem(gpu, MemoryType.HOST_ACCESSIBLE))
    pinned.numpy()[:] = data
    t = env.empty(data.shape, data.dtype, cuda_mem(gpu))
    assert t.__cuda_array_interface__["stream"] is None
    async with env.create_sync_stream(gpu) as producer:
        with hold_stream(producer) as release:
            upload = env.copy_tensors([pinned], [t], producer)
            cai = t.__cuda_array_interface__
            assert cai["stream"] == producer.handle
            view = CAIOnly(cai["data"][0], cai["shape"], cai["typestr"], stream=cai["stream"])
            out = np.zeros_like(data)
            future = env.copy_tensors([view], [out])
            await not_before_release(future)
            release()
            await future
            await upload
        np.testing.assert_array_equal(out, data)
    del t, pinned, upload, future, view


@pytest.mark.gpu
@needs_gpu
async def test_torch_and_cupy_tensors_in_and_out(
    cuda_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    """On a real GPU: PyTorch and CuPy tensors go into copy_tensors zero-copy, both ways,
    on a stream and without, by DLPack and by the CUDA Array Interface."""
    if DRIVER.kind != "real":
        pytest.skip(
            "CuPy and PyTorch need the real driver (their runtime does not run on the emulator)"
        )
    env, gpu = cuda_env
    data = np.arange(1 << 16, dtype=np.float32)
    checked = 0
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        x = torch.from_numpy(data).cuda()
        out = np.zeros_like(data)
        await env.copy_tensors([x], [out])
        np.testing.assert_array_equal(out, data)
        y = torch.zeros(data.shape, dtype=torch.float32, device="cuda")
        async with env.create_sync_stream(gpu) as stream:
            (imported,) = await env.copy_tensors([data * 2], [y], stream)
            assert imported.data_ptr == y.data_ptr()  # zero-copy
            await stream
        np.testing.assert_array_equal(y.cpu().numpy(), data * 2)
        x.mul_(3)  # on torch's stream: the copy below is ordered after it
        await env.copy_tensors([x], [out])
        np.testing.assert_array_equal(out, data * 3)
        del imported
        checked += 1
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError:
        cupy = None
    if cupy is not None:
        c = cupy.asarray(data)
        out = np.zeros_like(data)
        await env.copy_tensors([c], [out])
        np.testing.assert_array_equal(out, data)
        cai = CAIOnly(**_cai_args(c.__cuda_array_interface__), keep=c)
        d = cupy.zeros_like(c)
        async with env.create_sync_stream(gpu) as stream:
            await env.copy_tensors([cai], [d], stream)
            await stream
        np.testing.assert_array_equal(cupy.asnumpy(d), data)
        checked += 1
    if not checked:
        pytest.skip("neither CuPy nor PyTorch (with CUDA) is installed")


def _cai_args(cai: dict[str, Any]) -> dict[str, Any]:
    return {
        "ptr": cai["data"][0],
        "shape": tuple(cai["shape"]),
        "typestr": cai["typestr"],
        "readonly": cai["data"][1],
        "stream": cai.get("stream"),
        "strides": cai.get("strides"),
    }


@pytest.mark.gpu
@needs_gpu
async def test_cuda_another_environments_tensor_is_refused_when_wrapped() -> None:
    """The CUDA path of the ownership rule: environment A's CUDA tensor, passed to B through
    DLPack (A's capsule, or another library's over that memory) or through the CUDA Array
    Interface A's tensor gives, is refused; neither tensor changes."""
    async with cuda_environments(2) as [(a, gpu_a), (b, gpu_b)]:
        ta = a.empty((256,), np.float32, cuda_mem(gpu_a))
        tb = b.empty((256,), np.float32, cuda_mem(gpu_b))
        await a.copy_tensors([np.full(256, 1.0, np.float32)], [ta])
        await b.copy_tensors([np.full(256, 2.0, np.float32)], [tb])
        exports = aioep.abc.live_dlpack_exports()
        theirs = r"is device memory of another environment \(library 'cuda' of Environment"
        wrappers: list[Callable[[aioep.Tensor], Any]] = [
            DLPackOnly,
            lambda t: CapsuleProducer(t.data_ptr, (256,), (2, 32, 1), (KDL_CUDA, 0)),
            lambda t: CAIOnly(**_cai_args(t.__cuda_array_interface__)),
        ]
        for wrap in wrappers:
            with pytest.raises(InvalidArgument, match=rf"destination 0: .*{theirs}"):
                b.copy_tensors([np.full(256, 9.0, np.float32)], [wrap(ta)])
            out = np.zeros(256, np.float32)
            with pytest.raises(InvalidArgument, match=rf"source 0: .*{theirs}"):
                b.copy_tensors([wrap(ta)], [out])
            np.testing.assert_array_equal(out, 0)
        gc.collect()
        assert aioep.abc.live_dlpack_exports() == exports
        out_a, out_b = np.zeros(256, np.float32), np.zeros(256, np.float32)
        await a.copy_tensors([ta], [out_a])
        await b.copy_tensors([tb], [out_b])
        np.testing.assert_array_equal(out_a, 1.0)
        np.testing.assert_array_equal(out_b, 2.0)
        del ta, tb, wrap


@pytest.mark.gpu
@needs_gpu
async def test_cuda_export_refused_by_numpy_leaks_nothing_and_holds_its_buffer(
    cuda_env: tuple[aioep.Environment, aioep.EpDevice],
) -> None:
    """``np.from_dlpack`` of a CUDA tensor fails cleanly and releases its export (the
    environment then closes with nothing alive, so the context is released); a live export
    defers ``free()`` of an arena buffer until the consumer's deleter runs."""
    env, gpu = cuda_env
    env.create_shared_allocator(gpu, MemoryType.DEFAULT, aioep.AllocatorType.ARENA)
    t = env.empty((1024,), np.float32, cuda_mem(gpu))
    before = aioep.abc.live_dlpack_exports()
    for _ in range(3):
        with pytest.raises((BufferError, RuntimeError), match=r"[Uu]nsupported device"):
            np.from_dlpack(t)
    assert aioep.abc.live_dlpack_exports() == before
    capsule = t.__dlpack__()
    ptr = t.data_ptr
    t.buffer.free()
    assert t.buffer.freed
    other = env.empty((1024,), np.float32, cuda_mem(gpu))
    assert other.data_ptr + other.nbytes <= ptr or ptr + t.nbytes <= other.data_ptr
    del capsule  # dropped unconsumed: the export's release frees the buffer
    gc.collect()
    assert aioep.abc.live_dlpack_exports() == before
    again = env.empty((1024,), np.float32, cuda_mem(gpu))
    assert again.data_ptr == ptr
    del t, other, again
