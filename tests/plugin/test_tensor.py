"""Tensors and buffers: zero-copy numpy views, __array__, DLPack, validation."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _factories import FAKE_INFO, FakeGpuFactory

import aioep
from aioep._plugin.buffer import HOST_MEMORY_INFO
from aioep._plugin.tensor import object_tensor

pytestmark = pytest.mark.anyio


def test_from_numpy_is_zero_copy_and_keeps_array_alive() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = aioep.Tensor.from_numpy(a)
    assert t.shape == (3, 4)
    assert t.dtype == np.float32
    assert t.nbytes == 48
    assert t.size == 12
    assert t.ndim == 2
    assert t.strides == a.strides
    assert t.data_ptr == a.ctypes.data
    assert t.memory_info == HOST_MEMORY_INFO
    assert t.is_host_accessible
    view = t.numpy()
    assert np.shares_memory(view, a)
    view[0, 0] = 42
    assert a[0, 0] == 42
    ref = weakref.ref(a)
    del a, view
    gc.collect()
    assert ref() is not None  # the tensor keeps its array alive
    assert t.numpy()[0, 0] == 42


NUMPY_2 = np.lib.NumpyVersion(np.__version__) >= "2.0.0"


def test_numpy_view_keeps_tensor_alive() -> None:
    t = aioep.Tensor.from_numpy(np.arange(5, dtype=np.int64))
    view = t.numpy()
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is not None
    assert view.tolist() == [0, 1, 2, 3, 4]


def test_array_protocol() -> None:
    a = np.arange(6, dtype=np.int16)
    t = aioep.Tensor.from_numpy(a)
    same = np.asarray(t)
    assert np.shares_memory(same, a)
    copied = np.array(t, copy=True)
    assert not np.shares_memory(copied, a)
    np.testing.assert_array_equal(copied, a)
    as_float = np.asarray(t, dtype=np.float64)
    assert as_float.dtype == np.float64
    np.testing.assert_array_equal(as_float, a)
    if NUMPY_2:  # asarray(copy=...) is numpy 2's; numpy 1 calls __array__(dtype) only
        with pytest.raises(ValueError, match="needs a copy"):
            np.asarray(t, dtype=np.float64, copy=False)
        assert np.shares_memory(np.asarray(t, copy=False), a)


async def test_zero_size_tensors_convert_to_numpy() -> None:
    # A zero-size allocation has a NULL data pointer, which numpy 2.2 refuses to wrap.
    async with aioep.Environment(autoload=False) as env:
        for shape in [(0,), (3, 0), (0, 0, 2)]:
            t = env.empty(shape, np.float32)
            view = t.numpy()
            assert view.shape == shape
            assert view.dtype == np.float32
            assert view.flags.writeable
            assert np.asarray(t).shape == shape
            del t, view
    frozen = np.empty((2, 0), np.int8)
    frozen.flags.writeable = False
    assert not aioep.Tensor.from_numpy(frozen).numpy().flags.writeable


def test_dlpack_zero_copy_with_numpy() -> None:
    a = np.arange(10, dtype=np.float64)
    t = aioep.Tensor.from_numpy(a)
    assert t.__dlpack_device__() == (1, 0)
    b = np.from_dlpack(t)
    assert np.shares_memory(a, b)
    # Whether numpy's import is writable depends on its version; writes through the
    # tensor's own view show through the DLPack one either way.
    t.numpy()[3] = -1
    assert b[3] == -1


def test_dlpack_readonly_array() -> None:
    a = np.arange(4, dtype=np.uint8)
    a.flags.writeable = False
    t = aioep.Tensor.from_numpy(a)
    assert t.buffer.readonly
    assert not t.numpy().flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        t.numpy()[0] = 1
    if np.lib.NumpyVersion(np.__version__) < "2.1.0":
        # DLPack before 1.0 cannot flag read-only data: numpy refuses to export it.
        with pytest.raises(BufferError, match="readonly"):
            np.from_dlpack(t)
        return
    b = np.from_dlpack(t)
    assert not b.flags.writeable
    assert np.shares_memory(a, b)


def test_from_numpy_rejects_bad_arrays() -> None:
    with pytest.raises(aioep.InvalidArgument, match="C-contiguous"):
        aioep.Tensor.from_numpy(np.arange(10)[::2])
    with pytest.raises(aioep.InvalidArgument, match="Python objects"):
        aioep.Tensor.from_numpy(np.array([object()]))
    with pytest.raises(aioep.InvalidArgument, match=r"numpy.ndarray"):
        aioep.Tensor.from_numpy([1, 2, 3])  # type: ignore[arg-type]


def test_tensor_constructor_validation() -> None:
    buf = aioep.Buffer(0x1000, 64, HOST_MEMORY_INFO)
    with pytest.raises(aioep.InvalidArgument, match="every dimension"):
        aioep.Tensor(buf, (2, -1), "float32")
    with pytest.raises(aioep.InvalidArgument, match="every dimension"):
        aioep.Tensor(buf, (2.5,), "float32")  # type: ignore[arg-type]
    with pytest.raises(aioep.InvalidArgument, match="every dimension"):
        aioep.Tensor(buf, (True,), "float32")
    with pytest.raises(aioep.InvalidArgument, match="not a numpy dtype"):
        aioep.Tensor(buf, (2,), "floaty")
    with pytest.raises(aioep.InvalidArgument, match="Python objects"):
        aioep.Tensor(buf, (2,), object)
    with pytest.raises(
        aioep.InvalidArgument, match="needs 64 bytes at offset 4, but the buffer holds 64"
    ):
        aioep.Tensor(buf, (16,), "float32", byte_offset=4)
    with pytest.raises(aioep.InvalidArgument, match=r"aioep.Buffer"):
        aioep.Tensor(b"x" * 64, (16,), "float32")  # type: ignore[arg-type]
    t = aioep.Tensor(buf, 4, "int64", byte_offset=32)
    assert t.shape == (4,)
    assert t.data_ptr == 0x1020
    assert t.nbytes == 32


def test_scalar_and_empty_tensors() -> None:
    s = aioep.Tensor.from_numpy(np.array(3.5, dtype=np.float32))
    assert s.shape == ()
    assert s.size == 1
    assert s.nbytes == 4
    assert float(s.numpy()) == 3.5
    e = aioep.Tensor.from_numpy(np.zeros((0, 3), dtype=np.int32))
    assert e.size == 0
    assert e.nbytes == 0
    assert e.numpy().shape == (0, 3)


async def test_env_empty_shapes_and_dtypes() -> None:
    async with aioep.Environment(autoload=False) as env:
        t = env.empty((2, 3), "float16")
        assert t.shape == (2, 3)
        assert t.dtype == np.float16
        assert t.nbytes == 12
        assert t.buffer.allocator is env.get_shared_allocator(HOST_MEMORY_INFO)
        assert env.empty(0, "int8").nbytes == 0
        with pytest.raises(aioep.InvalidArgument, match="not a numpy dtype"):
            env.empty(3, "nonsense")
        with pytest.raises(aioep.InvalidArgument, match="every dimension"):
            env.empty((3, -2), "int8")
        with pytest.raises(aioep.InvalidArgument, match="MemoryInfo"):
            env.empty(3, "int8", "Cpu")  # type: ignore[arg-type]
        del t


async def test_env_empty_checks_shape_and_dtype_once() -> None:
    reads = {"shape": 0, "dtype": 0}

    class Shape:  # a sequence that counts how often it is read
        def __iter__(self) -> Iterator[int]:
            reads["shape"] += 1
            return iter((2, 3))

        def __len__(self) -> int:
            return 2

    class Dtype:  # numpy reads a dtype-like's ``dtype`` attribute
        @property
        def dtype(self) -> np.dtype[Any]:
            reads["dtype"] += 1
            return np.dtype("float32")

    async with aioep.Environment(autoload=False) as env:
        t = env.empty(Shape(), Dtype())  # type: ignore[arg-type]
        assert t.shape == (2, 3)
        assert t.dtype == np.float32
        assert t.nbytes == 24
        assert reads == {"shape": 1, "dtype": 1}
        alloc = env.get_shared_allocator(HOST_MEMORY_INFO)
        assert alloc is not None
        before = alloc.stats()["NumAllocs"]
        with pytest.raises(aioep.InvalidArgument, match="empty: dtype object holds Python"):
            env.empty(4, object)
        assert alloc.stats()["NumAllocs"] == before  # refused before anything is allocated
        del t


async def test_device_tensor_has_no_host_view() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("fake", FakeGpuFactory)
        t = env.empty(8, "float32", dev.memory_info())
        assert t.memory_info == FAKE_INFO
        assert not t.is_host_accessible
        with pytest.raises(aioep.InvalidArgument, match="device memory 'FakeGpu'"):
            t.numpy()
        with pytest.raises(aioep.InvalidArgument, match="device memory"):
            np.asarray(t)
        assert t.__dlpack_device__() == (12, 0)  # kDLExtDev: not a vendor aioep knows
        with pytest.raises(BufferError, match="no DLPack export"):
            t.__dlpack__()
        del t


async def test_buffer_free_is_idempotent_and_blocks_use() -> None:
    async with aioep.Environment(autoload=False) as env:
        alloc = env.get_shared_allocator(HOST_MEMORY_INFO)
        assert alloc is not None
        before = alloc.stats()["LiveBuffers"]
        t = env.empty(1024, "uint8")
        view = t.numpy()
        view[:] = 7
        assert alloc.stats()["LiveBuffers"] == before + 1
        t.buffer.free()
        t.buffer.free()
        assert t.buffer.freed
        assert alloc.stats()["LiveBuffers"] == before
        assert "freed" in repr(t.buffer)
        with pytest.raises(aioep.InvalidArgument, match="was freed"):
            t.numpy()
        # A view taken before the free still reads mapped memory (never a crash).
        assert int(view.sum()) == 7 * 1024


def test_freeing_a_wrapped_array_buffer() -> None:
    t = aioep.Tensor.from_numpy(np.ones(8))
    t.buffer.free()
    assert t.buffer.freed
    with pytest.raises(aioep.InvalidArgument, match="was freed"):
        t.numpy()


async def test_dropping_the_tensor_frees_its_buffer() -> None:
    async with aioep.Environment(autoload=False) as env:
        alloc = env.get_shared_allocator(HOST_MEMORY_INFO)
        assert alloc is not None
        before = alloc.stats()
        t = env.empty(4096, "uint8")
        assert alloc.stats()["InUse"] == before["InUse"] + 4096
        del t
        gc.collect()
        assert alloc.stats()["InUse"] == before["InUse"]
        assert alloc.stats()["NumAllocs"] == before["NumAllocs"] + 1


def test_pinned_memory_dlpack_device_matches_its_export() -> None:
    # Pinned (HOST_ACCESSIBLE) memory of a GPU is exported through numpy, so the
    # device it reports must be the CPU, or consumers would read it as device memory.
    host = np.arange(6, dtype=np.float32)
    pinned_info = aioep.MemoryInfo(
        "CudaPinned",
        aioep.MemoryDevice(aioep.DeviceType.GPU, aioep.MemoryType.HOST_ACCESSIBLE, 0x10DE, 0),
    )
    buffer = aioep.Buffer(host.ctypes.data, host.nbytes, pinned_info, owner=host)
    tensor = aioep.Tensor(buffer, (6,), np.float32)
    assert tensor.__dlpack_device__() == (1, 0)
    view = np.from_dlpack(tensor)
    assert np.shares_memory(view, host)
    np.testing.assert_array_equal(view, host)


def test_string_tensors_from_sessions_are_host_only_and_read_only() -> None:
    strings = np.array([["a", "bc"], ["", "d"]], dtype=object)
    t = object_tensor(strings)
    assert t.shape == (2, 2)
    assert t.dtype == object
    assert t.is_host_accessible
    view = t.numpy()
    assert view.tolist() == strings.tolist()
    assert not view.flags.writeable
    assert t.buffer.readonly
    with pytest.raises(BufferError):
        t.__dlpack__()
    with pytest.raises(aioep.InvalidArgument, match="Python objects"):
        aioep.Tensor.from_numpy(strings)
    scalar = object_tensor(np.array("x", dtype=object))
    assert scalar.shape == ()
    assert scalar.numpy().item() == "x"
