"""DLPack exports of aioep tensors: numpy's capsule machinery (no Python in a capsule
destructor), no export leaked whatever the consumer does, and a live export holding its
buffer (``free()`` waits for the export's release; no allocation gets that memory meanwhile).

Consumers: numpy, and a consumer written with ctypes as a C library would be (it renames the
capsule and calls the deleter when done).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _factories import MakeEnv

import aioep
from aioep import AllocatorType, MemoryType
from aioep.abc import DLManagedTensor, live_dlpack_exports

pytest.importorskip("aioep_sim")

pytestmark = pytest.mark.anyio

_get_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi["PyCapsule_SetName"]
_set_name.restype = ctypes.c_int
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
_USED = ctypes.create_string_buffer(b"used_dltensor")  # must outlive every capsule renamed


def consume(capsule: Any) -> tuple[DLManagedTensor, Callable[[], None]]:
    """Take a legacy capsule as a C consumer does: rename it ``used_dltensor`` (the capsule
    no longer owns the tensor) and return the managed tensor and a call of its deleter."""
    managed = DLManagedTensor.from_address(_get_pointer(capsule, b"dltensor"))
    assert _set_name(capsule, _USED) == 0
    deleter = managed.deleter
    return managed, lambda: deleter(ctypes.pointer(managed))


@contextlib.contextmanager
def no_unraisable() -> Iterator[list[Any]]:
    """Record what the interpreter could not raise (an error in a destructor) meanwhile."""
    seen: list[Any] = []
    previous = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        yield seen
    finally:
        sys.unraisablehook = previous
    assert not seen, [str(u.exc_value) for u in seen]


async def _sim(make_env: MakeEnv) -> tuple[aioep.Environment, aioep.EpDevice]:
    env = await make_env()
    return env, env.ep_devices(ep_name="SimExecutionProvider")[0]


def _info(dev: aioep.EpDevice, kind: MemoryType) -> aioep.MemoryInfo:
    info = dev.memory_info(kind)
    assert info is not None
    return info


def _disjoint(a: aioep.Tensor, ptr: int, nbytes: int) -> bool:
    return a.data_ptr + a.nbytes <= ptr or ptr + nbytes <= a.data_ptr


# -- leaks and capsule destructors -------------------------------------------------------------
async def test_numpy_refusing_a_device_export_raises_cleanly_and_leaks_nothing(
    make_env: MakeEnv,
) -> None:
    """``np.from_dlpack`` of a device tensor: numpy's own refusal (never SystemError, nothing
    unraisable from a destructor that ran with numpy's error set), and the export it dropped
    is released: the buffer goes back when the tensor does."""
    env, sim = await _sim(make_env)
    t = env.empty((64,), np.float32, _info(sim, MemoryType.DEFAULT))
    allocator = t.buffer.allocator
    assert allocator is not None
    before = live_dlpack_exports()
    with no_unraisable():
        for _ in range(3):
            with pytest.raises((BufferError, RuntimeError), match=r"[Uu]nsupported device"):
                np.from_dlpack(t)
    assert live_dlpack_exports() == before
    del t
    gc.collect()
    assert allocator.live_buffers == 0


async def test_host_export_through_numpy_is_released_with_the_array(make_env: MakeEnv) -> None:
    env, sim = await _sim(make_env)
    for info in (aioep.abc.HOST_MEMORY_INFO, _info(sim, MemoryType.HOST_ACCESSIBLE)):
        t = env.empty((4, 8), np.int16, info)
        t.numpy()[:] = np.arange(32, dtype=np.int16).reshape(4, 8)
        before = live_dlpack_exports()
        with no_unraisable():
            view = np.from_dlpack(t)
            assert live_dlpack_exports() == before + 1
            assert np.shares_memory(view, t.numpy())
            np.testing.assert_array_equal(view, t.numpy())
            del view
            gc.collect()
        assert live_dlpack_exports() == before
        del t


async def test_c_consumer_and_unconsumed_capsule_release_the_export(make_env: MakeEnv) -> None:
    """A consumer that calls the deleter, and a capsule that dies unconsumed, each release
    their export once; the capsule describes the tensor on its device."""
    env, sim = await _sim(make_env)
    t = env.empty((3, 5), np.float32, _info(sim, MemoryType.DEFAULT))
    before = live_dlpack_exports()
    with no_unraisable():
        managed, release = consume(t.__dlpack__())
        dl = managed.dl_tensor
        assert dl.data == t.data_ptr
        assert (dl.device.device_type, dl.device.device_id) == t.__dlpack_device__() == (12, 0)
        assert [dl.shape[i] for i in range(dl.ndim)] == [3, 5]
        assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (2, 32, 1)
        assert live_dlpack_exports() == before + 1
        release()
        assert live_dlpack_exports() == before
        capsule = t.__dlpack__()
        assert live_dlpack_exports() == before + 1
        del capsule
        gc.collect()
        assert live_dlpack_exports() == before
    del t


async def test_device_export_refuses_a_copy_or_another_device(make_env: MakeEnv) -> None:
    env, sim = await _sim(make_env)
    t = env.empty((4,), np.float32, _info(sim, MemoryType.DEFAULT))
    before = live_dlpack_exports()
    with pytest.raises(BufferError, match="copy=True is not supported"):
        t.__dlpack__(max_version=(1, 0), copy=True)
    with pytest.raises(BufferError, match=r"on DLPack device \(12, 0\), not \(1, 0\)"):
        t.__dlpack__(max_version=(1, 0), dl_device=(1, 0))
    assert live_dlpack_exports() == before
    del t


# -- a live export holds its buffer --------------------------------------------------------------
@pytest.mark.parametrize("arena", [False, True])
@pytest.mark.parametrize("kind", [MemoryType.DEFAULT, MemoryType.HOST_ACCESSIBLE])
async def test_free_waits_for_the_dlpack_export(
    make_env: MakeEnv, kind: MemoryType, arena: bool
) -> None:
    """``free()`` while an export lives: the buffer reads as freed at once, no allocation gets
    its memory (a write through the export cannot reach a new tensor), and releasing the
    export gives the memory back (the next allocation of that size reuses it)."""
    env, sim = await _sim(make_env)
    if arena:
        env.create_shared_allocator(sim, kind, AllocatorType.ARENA)
    info = _info(sim, kind)
    t = env.empty((256,), np.float32, info)
    ptr, nbytes = t.data_ptr, t.nbytes
    host = kind is MemoryType.HOST_ACCESSIBLE
    if host:
        export: Any = np.from_dlpack(t)  # numpy holds the export
        release: Callable[[], None] = lambda: None  # noqa: E731  # dropping `export` does
    else:
        _managed, release = consume(t.__dlpack__())
    t.buffer.free()
    assert t.buffer.freed
    with pytest.raises(BufferError, match="was freed"):
        t.__dlpack__()  # no new export of a freed tensor
    with pytest.raises(aioep.InvalidArgument, match="was freed"):
        env.copy_tensors([np.zeros(256, np.float32)], [t])
    fresh = [env.empty((256,), np.float32, info) for _ in range(3)]
    assert all(_disjoint(f, ptr, nbytes) for f in fresh)
    allocator = t.buffer.allocator
    assert allocator is not None
    live = allocator.live_buffers
    if host:
        for f in fresh:
            f.numpy()[:] = 2.0
        # The consumer writes through its export (numpy 1.x imports read-only: write as C).
        sevens = np.full(256, 7.0, np.float32)
        ctypes.memmove(export.ctypes.data, sevens.ctypes.data, nbytes)
        np.testing.assert_array_equal(export, 7.0)
        for f in fresh:
            np.testing.assert_array_equal(f.numpy(), 2.0)
        del export
    release()
    gc.collect()
    assert allocator.live_buffers == live - 1  # the memory went back
    again = env.empty((256,), np.float32, info)
    if arena:  # the arena hands the chunk out again (sim device memory and malloc: not so)
        assert again.data_ptr == ptr
    del t, fresh, again


async def test_free_while_an_unconsumed_capsule_lives(make_env: MakeEnv) -> None:
    env, sim = await _sim(make_env)
    env.create_shared_allocator(sim, MemoryType.DEFAULT, AllocatorType.ARENA)
    info = _info(sim, MemoryType.DEFAULT)
    t = env.empty((64,), np.int32, info)
    ptr = t.data_ptr
    capsule = t.__dlpack__()
    allocator = t.buffer.allocator
    assert allocator is not None
    aioep.Allocator.free(allocator, t.buffer)  # the allocator's free defers the same way
    assert t.buffer.freed
    other = env.empty((64,), np.int32, info)
    assert other.data_ptr != ptr
    del capsule
    gc.collect()
    assert env.empty((64,), np.int32, info).data_ptr == ptr
    del t, other


async def test_free_of_a_pinned_buffer_is_still_refused_while_exported(
    make_env: MakeEnv,
) -> None:
    """A copy in flight (a pin) refuses ``free()`` as before; an export only defers it."""
    env, sim = await _sim(make_env)
    t = env.empty((16,), np.float32, _info(sim, MemoryType.DEFAULT))
    _managed, release = consume(t.__dlpack__())
    t.buffer._pin()
    with pytest.raises(aioep.InUseError):
        t.buffer.free()
    assert not t.buffer.freed
    t.buffer._unpin()
    release()
    t.buffer.free()
    assert t.buffer.freed
    del t
