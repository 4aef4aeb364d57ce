"""copy_tensors: validation before anything is written, routing, CopyFuture, cancellation."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
from _factories import FAKE_DEVICE, FakeGpuFactory, RecordingTransfer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioep
from aioep._plugin.buffer import HOST_MEMORY_INFO

pytestmark = pytest.mark.anyio

SENTINEL = 0x5A


def _dst(n: int, dtype: Any = np.uint8) -> np.ndarray[Any, Any]:
    a = np.empty(n, dtype=dtype)
    a.view(np.uint8)[:] = SENTINEL
    return a


def _untouched(*arrays: np.ndarray[Any, Any]) -> bool:
    return all(bool((a.view(np.uint8) == SENTINEL).all()) for a in arrays)


# -- validation: each bad call raises the right subclass and writes nothing ----------------


async def test_count_mismatch() -> None:
    async with aioep.Environment(autoload=False):
        d = _dst(4)
        with pytest.raises(aioep.InvalidArgument, match=r"2 source.*1 destination"):
            aioep.copy_tensors([np.ones(4, np.uint8), np.ones(4, np.uint8)], [d])
        assert _untouched(d)


async def test_not_a_list() -> None:
    async with aioep.Environment(autoload=False):
        d = _dst(4)
        with pytest.raises(aioep.InvalidArgument, match="src must be a list"):
            aioep.copy_tensors(np.ones(4, np.uint8), [d])  # type: ignore[arg-type]
        with pytest.raises(aioep.InvalidArgument, match="dst must be a list"):
            aioep.copy_tensors([np.ones(4, np.uint8)], d)  # type: ignore[arg-type]
        with pytest.raises(aioep.InvalidArgument, match=r"destination 0: expected an aioep.Tensor"):
            aioep.copy_tensors([np.ones(4, np.uint8)], [b"abcd"])  # type: ignore[list-item]
        assert _untouched(d)


async def test_dtype_mismatch() -> None:
    async with aioep.Environment(autoload=False):
        d = _dst(4, np.int32)
        with pytest.raises(aioep.InvalidArgument, match="pair 0: source dtype float32 differs"):
            aioep.copy_tensors([np.ones(4, np.float32)], [d])
        assert _untouched(d)


async def test_size_mismatch_is_checked_before_any_copy() -> None:
    # notes F.35: pair 1 is bad, so pair 0 must not be copied either.
    async with aioep.Environment(autoload=False):
        d0, d1 = _dst(4, np.float32), _dst(5, np.float32)
        with pytest.raises(aioep.InvalidArgument, match="pair 1: Tensor size mismatch"):
            aioep.copy_tensors([np.ones(4, np.float32), np.ones(6, np.float32)], [d0, d1])
        assert _untouched(d0, d1)


async def test_shape_mismatch_needs_allow_reshape() -> None:
    async with aioep.Environment(autoload=False):
        src = np.arange(6, dtype=np.int16)
        d = _dst(6, np.int16).reshape(2, 3)
        with pytest.raises(aioep.InvalidArgument, match="allow_reshape=True"):
            aioep.copy_tensors([src], [d])
        assert _untouched(d)
        await aioep.copy_tensors([src], [d], allow_reshape=True)
        np.testing.assert_array_equal(d.ravel(), src)


async def test_readonly_and_noncontiguous_destinations() -> None:
    async with aioep.Environment(autoload=False):
        d = _dst(8)
        d.flags.writeable = False
        with pytest.raises(aioep.InvalidArgument, match=r"pair 0: destination .* is read-only"):
            aioep.copy_tensors([np.ones(8, np.uint8)], [d])
        assert _untouched(d)
        wide = _dst(16)
        with pytest.raises(aioep.InvalidArgument, match="not C-contiguous"):
            aioep.copy_tensors([np.ones(8, np.uint8)], [wide[::2]])
        assert _untouched(wide)


async def test_overlapping_destinations() -> None:
    async with aioep.Environment(autoload=False):
        buf = _dst(16)
        with pytest.raises(aioep.InvalidArgument, match="overlaps destination"):
            aioep.copy_tensors([np.ones(8, np.uint8), np.ones(8, np.uint8)], [buf[0:8], buf[4:12]])
        assert _untouched(buf)
        # Adjacent, not overlapping: fine.
        await aioep.copy_tensors(
            [np.full(8, 1, np.uint8), np.full(8, 2, np.uint8)], [buf[0:8], buf[8:16]]
        )
        assert buf.tolist() == [1] * 8 + [2] * 8


async def test_destination_overlapping_a_source() -> None:
    async with aioep.Environment(autoload=False):
        buf = np.arange(16, dtype=np.uint8)
        before = buf.copy()
        with pytest.raises(aioep.InvalidArgument, match="destination 0 overlaps source 0"):
            aioep.copy_tensors([buf[0:8]], [buf[4:12]])
        with pytest.raises(aioep.InvalidArgument, match="overlaps"):
            aioep.copy_tensors([buf[0:4], buf[8:12]], [buf[12:16], buf[2:6]])
        with pytest.raises(aioep.InvalidArgument, match="overlaps"):
            aioep.copy_tensors([buf], [buf])
        np.testing.assert_array_equal(buf, before)
        # Sources may overlap each other.
        d1, d2 = _dst(8), _dst(8)
        await aioep.copy_tensors([buf[0:8], buf[4:12]], [d1, d2])
        assert d1.tolist() == list(range(8))
        assert d2.tolist() == list(range(4, 12))


async def test_strided_sources_are_packed_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioep._plugin.transfer import PACK_INLINE_BYTES, CopyPlan

    packed_on: list[int] = []
    real_pack = CopyPlan.pack

    def pack(self: CopyPlan) -> None:
        if self.packs:
            packed_on.append(threading.get_ident())
        real_pack(self)

    monkeypatch.setattr(CopyPlan, "pack", pack)
    async with aioep.Environment(autoload=False):
        n = 16 * PACK_INLINE_BYTES  # beyond the host inline limit too: the copy runs off-loop
        big = np.arange(2 * n, dtype=np.uint8).reshape(2, n)
        small = np.arange(64, dtype=np.int32)
        d_big, d_col, d_small = _dst(n), _dst(2), _dst(32, np.int32)
        fut = aioep.copy_tensors(
            [big[:, ::2], big[:, 1], small[::2]], [d_big.reshape(2, n // 2), d_col, d_small]
        )
        await fut
        np.testing.assert_array_equal(d_big.reshape(2, n // 2), big[:, ::2])
        np.testing.assert_array_equal(d_col, big[:, 1])
        np.testing.assert_array_equal(d_small, small[::2])
        assert packed_on
        assert threading.get_ident() not in packed_on
        # A strided source may overlap its destination: it is read before anything is written.
        buf = np.arange(16, dtype=np.uint8)
        expected = buf[::2].copy()
        await aioep.copy_tensors([buf[::2]], [buf[8:]])
        np.testing.assert_array_equal(buf[8:], expected)


async def test_no_transfer_names_both_devices() -> None:
    async with aioep.Environment(autoload=False) as env:
        env.register_library("fake", FakeGpuFactory)
        (dev,) = env.ep_devices(ep_name=FakeGpuFactory.name)
        gpu = env.empty(4, "float32", dev.memory_info())
        env.unregister_library  # noqa: B018 - keep the library: remove only its transfer
        lib = env._libraries["fake"]
        assert isinstance(lib.transfer, RecordingTransfer)
        env._transfers.remove(("fake", lib.transfer))
        d = _dst(4, np.float32)
        with pytest.raises(aioep.NotImplementedByEp, match=r"gpu:0xbe57:0 to cpu:0x0:0") as e:
            aioep.copy_tensors([gpu], [d])
        assert e.value.code is aioep.ErrorCode.NOT_IMPLEMENTED
        assert isinstance(e.value, NotImplementedError)
        assert _untouched(d)
        env._transfers.append(("fake", lib.transfer))
        del gpu, e  # the traceback holds the tensors too


async def test_freed_buffer_is_rejected() -> None:
    async with aioep.Environment(autoload=False) as env:
        src = env.empty(32, "uint8")
        src.numpy()[:] = 1
        src.buffer.free()
        d = _dst(32)
        with pytest.raises(aioep.InvalidArgument, match=r"pair 0: source buffer .* was freed"):
            aioep.copy_tensors([src], [d])
        dst = env.empty(32, "uint8")
        dst.buffer.free()
        with pytest.raises(aioep.InvalidArgument, match=r"destination buffer .* was freed"):
            aioep.copy_tensors([np.ones(32, np.uint8)], [dst])
        assert _untouched(d)


async def test_stream_from_another_environment() -> None:
    async with aioep.Environment(autoload=False) as other:
        (dev,) = other.register_library("fake", FakeGpuFactory)
        async with (
            other.create_sync_stream(dev) as stream,
            aioep.Environment(autoload=False) as inner,
        ):
            with pytest.raises(aioep.InvalidArgument, match="does not belong"):
                inner.copy_tensors([np.ones(2)], [np.zeros(2)], stream)
            # The module-level function copies in the environment that owns the stream.
            out = np.zeros(2)
            await aioep.copy_tensors([np.ones(2)], [out], stream)
            assert out.tolist() == [1.0, 1.0]
            with pytest.raises(aioep.InvalidArgument, match="must be a SyncStream"):
                aioep.copy_tensors([np.ones(2)], [np.zeros(2)], "s")  # type: ignore[arg-type]


# -- results ----------------------------------------------------------------------------


async def test_empty_lists_give_done_future() -> None:
    async with aioep.Environment(autoload=False):
        fut = aioep.copy_tensors([], [])
        assert fut.done()
        assert fut.status is aioep.CopyStatus.DONE
        assert fut.result() == []
        assert await fut == []
        assert fut.notification.done()


async def test_routes_groups_to_transfers() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("fake", FakeGpuFactory)
        lib_transfer = env._libraries["fake"].transfer
        assert isinstance(lib_transfer, RecordingTransfer)
        a = np.arange(100, dtype=np.float32)
        b = np.arange(50, dtype=np.int64)
        ga = env.empty(100, "float32", dev.memory_info())
        gb = env.empty(50, "int64", dev.memory_info())
        ha = np.zeros_like(a)
        # Two pairs host->gpu and one host->host in one batch.
        out = await aioep.copy_tensors([a, b, a], [ga, gb, ha])
        assert out[0] is ga
        assert out[2].data_ptr == ha.ctypes.data
        assert lib_transfer.calls == 1  # one batched call for the host->gpu group
        assert ga.device == FAKE_DEVICE
        ra, rb = np.zeros_like(a), np.zeros_like(b)
        await aioep.copy_tensors([ga, gb], [ra, rb])
        np.testing.assert_array_equal(ra, a)
        np.testing.assert_array_equal(rb, b)
        np.testing.assert_array_equal(ha, a)
        del ga, gb, out


async def test_backend_failure_becomes_device_error() -> None:
    class Failing(RecordingTransfer):
        def copy_tensors(self, pairs: Any, stream: Any) -> None:
            raise OSError("DMA engine hung")

    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("fake", FakeGpuFactory)
        lib = env._libraries["fake"]
        idx = env._transfers.index(("fake", lib.transfer))  # type: ignore[arg-type]
        env._transfers[idx] = ("fake", Failing("x"))
        g = env.empty(4, "uint8", dev.memory_info())
        fut = aioep.copy_tensors([np.ones(4, np.uint8)], [g])
        with pytest.raises(aioep.DeviceError, match="DMA engine hung") as e:
            await fut
        assert "Failing.copy_tensors failed: OSError" in str(e.value)
        assert fut.status is aioep.CopyStatus.FAILED
        assert isinstance(fut.exception(), aioep.DeviceError)
        with pytest.raises(aioep.DeviceError):
            fut.result()
        env._transfers[idx] = ("fake", lib.transfer)  # type: ignore[assignment]
        del g, fut, e
        gc.collect()  # the raised error's traceback and the future form a cycle


DTYPES = [
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
]  # fmt: skip


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from(DTYPES),
    sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_host_copies_bit_exact(dtype: Any, sizes: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    srcs = [
        rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
        for n in sizes
    ]
    env = aioep.Environment(autoload=False).open()
    try:
        dsts = [env.empty(s.shape, s.dtype) for s in srcs]
        env.copy_tensors(srcs, dsts).wait(timeout=30)
        # bit-exact (NaN payloads included)
        assert [d.numpy().tobytes() for d in dsts] == [s.tobytes() for s in srcs]
        del dsts
    finally:
        env.close()


async def test_large_parallel_copy_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    import aioep._environment.host

    copied_on: set[int] = set()
    real_memmove = aioep._environment.host._memmove

    def memmove(dst: int, src: int, n: int) -> None:
        copied_on.add(threading.get_ident())
        real_memmove(dst, src, n)

    monkeypatch.setattr(aioep._environment.host, "_memmove", memmove)
    async with aioep.Environment(autoload=False) as env:
        n = (24 << 20) + 4099  # several threads' worth, not a multiple of the split
        src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        small = np.arange(1000, dtype=np.uint8)
        dst = env.empty(n, "uint8")
        dst_small = _dst(1000)
        fut = aioep.copy_tensors([src, small], [dst, dst_small])
        await fut
        assert np.array_equal(dst.numpy(), src)
        np.testing.assert_array_equal(dst_small, small)
        del dst, fut
    assert len(copied_on) > 1  # split across copy threads
    assert threading.get_ident() not in copied_on  # large copies run off the event loop


# -- CopyFuture API ------------------------------------------------------------------------


async def _gated_copy(
    env: aioep.Environment,
) -> tuple[aioep.CopyFuture, Callable[[], None], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    (dev,) = env.ep_devices(ep_name="host")
    stream = env.create_sync_stream(dev)
    gate = aioep.abc.HostNotification()
    stream.impl.enqueue_wait(gate)  # type: ignore[attr-defined]
    src = np.arange(4096, dtype=np.uint8)
    dst = _dst(4096)
    fut = aioep.copy_tensors([src], [dst], stream)
    return fut, gate.set, src, dst


async def test_copy_future_api() -> None:
    async with aioep.Environment(autoload=False) as env:
        fut, release, src, dst = await _gated_copy(env)
        assert not fut.done()
        assert fut.status is aioep.CopyStatus.PENDING
        assert "pending" in repr(fut)
        assert fut.exception() is None
        with pytest.raises(aioep.InvalidArgument, match="still in flight"):
            fut.result()
        try:
            # A blocking wait on the loop's thread while the copy is pending warns (it stalls
            # the loop); it still times out.
            with (
                pytest.warns(RuntimeWarning, match=r"wait\(\) blocks the event loop.*'await'"),
                pytest.raises(TimeoutError),
            ):
                fut.wait(timeout=0.01)
            # From a worker thread it is the right tool: no warning.
            with pytest.raises(TimeoutError):
                await anyio.to_thread.run_sync(lambda: fut.wait(timeout=0.01))
        except BaseException:
            release()  # or the environment's close waits for the gated copy forever
            raise
        seen: list[aioep.CopyFuture] = []
        called = threading.Event()

        def cb(f: aioep.CopyFuture) -> None:
            seen.append(f)
            called.set()

        fut.add_done_callback(cb)
        release()
        (out,) = await fut
        assert out.data_ptr == dst.ctypes.data
        np.testing.assert_array_equal(dst, src)
        assert fut.done()
        assert fut.status is aioep.CopyStatus.DONE
        assert called.wait(5)
        assert seen == [fut]
        assert fut.wait(timeout=1)[0] is out  # done: no warning (filterwarnings = error)
        late: list[aioep.CopyFuture] = []
        fut.add_done_callback(late.append)  # already done: called at once
        assert late == [fut]
        assert fut.notification.done()
        assert "done" in repr(fut)
        await env._libraries["host"].streams.pop().aclose()


async def test_pending_future_pins_buffers() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.ep_devices(ep_name="host")
        async with env.create_sync_stream(dev) as stream:
            gate = aioep.abc.HostNotification()
            stream.impl.enqueue_wait(gate)  # type: ignore[attr-defined]
            dst = env.empty(64, "uint8")
            fut = aioep.copy_tensors([np.ones(64, np.uint8)], [dst], stream)
            with pytest.raises(aioep.InUseError, match="used by 1 operation"):
                dst.buffer.free()
            gate.set()
            await fut
            dst.buffer.free()  # unpinned once done
            assert dst.buffer.freed


async def test_cancelled_await_leaves_copy_running_and_buffers_alive() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.ep_devices(ep_name="host")
        alloc = env.get_shared_allocator(HOST_MEMORY_INFO)
        assert alloc is not None
        baseline = alloc.live_buffers
        async with env.create_sync_stream(dev) as stream:
            gate = aioep.abc.HostNotification()
            stream.impl.enqueue_wait(gate)  # type: ignore[attr-defined]
            src = env.empty(1 << 16, "uint8")
            src.numpy()[:] = 9
            dst = env.empty(1 << 16, "uint8")
            fut = aioep.copy_tensors([src], [dst], stream)
            landed: list[np.ndarray[Any, Any]] = []
            fut.add_done_callback(lambda f: landed.append(f.result()[0].numpy().copy()))
            refs = [weakref.ref(src), weakref.ref(dst)]
            with anyio.move_on_after(0.05) as scope:
                await fut
            assert scope.cancelled_caught
            assert not fut.done()
            del src, dst, fut
            gc.collect()
            # Only the copy holds them now: still alive, memory not handed back.
            assert all(r() is not None for r in refs)
            assert alloc.live_buffers == baseline + 2
            gate.set()
            await stream
        # The copy ran its course into the destination, then released both buffers.
        assert len(landed) == 1
        assert bool((landed[0] == 9).all())
        gc.collect()
        assert all(r() is None for r in refs)
        assert alloc.live_buffers == baseline


@pytest.mark.parametrize(
    "dtype", [np.float32, np.dtype(">i4"), np.dtype([("a", "u1"), ("b", "<f8")])]
)
async def test_small_numpy_batches_copy_inline(dtype: Any) -> None:
    async with aioep.Environment(autoload=False):
        rng = np.random.default_rng(3)
        srcs = [rng.integers(0, 256, 36 * k, dtype=np.uint8).view(dtype) for k in (1, 2, 3)]
        dsts = [np.zeros_like(s) for s in srcs]
        fut = aioep.copy_tensors(srcs, dsts)
        assert fut.done()  # small host batches complete before copy_tensors returns
        out = await fut
        for s, d, t in zip(srcs, dsts, out):
            assert d.tobytes() == s.tobytes()
            assert t.data_ptr == d.ctypes.data
            assert t.dtype == d.dtype
            assert t.shape == d.shape


async def test_small_batch_fallbacks_still_copy_or_reject() -> None:
    async with aioep.Environment(autoload=False) as env:
        a = np.arange(16, dtype=np.int32)
        # Overlapping sources, a Tensor destination, 5 pairs: general path, same result.
        dsts = [np.zeros(8, np.int32), env.empty(8, "int32")]
        await aioep.copy_tensors([a[0:8], a[4:12]], dsts)
        assert dsts[0].tolist() == list(range(8))
        assert dsts[1].numpy().tolist() == list(range(4, 12))
        many = [np.zeros(2, np.int32) for _ in range(5)]
        await aioep.copy_tensors([a[2 * i : 2 * i + 2] for i in range(5)], many)
        assert [m.tolist() for m in many] == [[2 * i, 2 * i + 1] for i in range(5)]
        d = _dst(16, np.int32)
        with pytest.raises(aioep.InvalidArgument, match="overlaps"):
            aioep.copy_tensors([a, a], [d, d])
        assert _untouched(d)
        del dsts
