"""Ownership: a tensor is only read or written through the memory that made it (issue 25).

Device tensors of another environment are refused (InvalidArgument naming the owner), those
of a closed environment with ClosedError; two instances of the sim factory in one environment
never alias; freed tensors never reach a session; the module-level ``copy_tensors`` and
``current_environment`` find the environment from the tensors' owner, the context, or the one
open environment of the process."""

from __future__ import annotations

import contextvars
import gc

import anyio
import anyio.to_thread
import numpy as np
import pytest

pytest.importorskip("aioep_sim")

import aioep
from aioep import ClosedError, EpError, InvalidArgument, MemoryType

pytestmark = pytest.mark.anyio


def _sim(env: aioep.Environment, name: str = "sim") -> aioep.EpDevice:
    devices = env.register_library(name, "aioep_sim:SimFactory")
    return devices[0]


async def _device_tensor(env: aioep.Environment, dev: aioep.EpDevice, value: float) -> aioep.Tensor:
    info = dev.memory_info(MemoryType.DEFAULT)
    assert info is not None
    t = env.empty(8, np.float32, info)
    await env.copy_tensors([np.full(8, value, np.float32)], [t])
    return t


async def _read(env: aioep.Environment, t: aioep.Tensor) -> list[float]:
    out = np.empty(t.shape, t.dtype)
    await env.copy_tensors([t], [out])
    return [float(v) for v in out]


async def test_tensor_of_another_environment_is_refused() -> None:
    async with aioep.Environment(autoload=False) as a, aioep.Environment(autoload=False) as b:
        ta = await _device_tensor(a, _sim(a), 1.0)
        tb = await _device_tensor(b, _sim(b), 2.0)
        for src, dst in (([ta], [np.zeros(8, np.float32)]), ([np.ones(8, np.float32)], [ta])):
            with pytest.raises(InvalidArgument, match=r"library 'sim' of Environment #\d+"):
                b.copy_tensors(src, dst)
        with pytest.raises(InvalidArgument, match="not of Environment"):
            b.copy_tensors([ta], [tb])
        # Nothing was written anywhere: each environment still reads its own data.
        assert await _read(a, ta) == [1.0] * 8
        assert await _read(b, tb) == [2.0] * 8
        # The module-level function copies in the owner's environment, whichever is current.
        out = np.zeros(8, np.float32)
        await aioep.copy_tensors([ta], [out])
        assert out.tolist() == [1.0] * 8
        del ta, tb, src, dst


async def test_tensor_of_a_closed_environment_is_closed_error() -> None:
    a = await aioep.Environment(autoload=False).__aenter__()
    old = await _device_tensor(a, _sim(a), 3.0)
    await a.aclose()  # the tensor still named by `old` is no warning: it is in the report
    assert a.close_report is not None
    assert a.close_report.live_buffers == 1
    async with aioep.Environment(autoload=False) as b:
        live = await _device_tensor(b, _sim(b), 4.0)
        # Sim addresses are unique in the process (as with a GPU's unified addressing): the
        # closed environment's address is not the new one's, and the check is not by address.
        assert old.buffer.ptr != live.buffer.ptr
        with pytest.raises(ClosedError, match="closed"):
            b.copy_tensors([np.zeros(8, np.float32)], [old])
        with pytest.raises(ClosedError, match="closed"):
            aioep.copy_tensors([old], [np.zeros(8, np.float32)])
        assert await _read(b, live) == [4.0] * 8  # the live tensor at that address is intact
        # Host memory stays valid after its environment closed: accepted anywhere.
        del live
    del old


async def test_two_sim_registrations_never_alias() -> None:
    async with aioep.Environment(autoload=False) as env:
        d1 = _sim(env, "sim")
        d2 = _sim(env, "sim2")
        m1, m2 = d1.memory_info(MemoryType.DEFAULT), d2.memory_info(MemoryType.DEFAULT)
        assert m1 is not None
        assert m2 is not None
        assert m1.device != m2.device
        assert env.get_shared_allocator(m1) is not env.get_shared_allocator(m2)
        t1 = await _device_tensor(env, d1, 1.0)
        t2 = await _device_tensor(env, d2, 2.0)
        assert await _read(env, t1) == [1.0] * 8
        assert await _read(env, t2) == [2.0] * 8
        # Device to device across the two instances goes through the host (no transfer copies
        # between them): refused, never a write into the other instance's memory.
        with pytest.raises(aioep.NotImplementedByEp):
            env.copy_tensors([t1], [t2])
        await env.copy_tensors([np.full(8, 5.0, np.float32)], [t2])
        assert await _read(env, t1) == [1.0] * 8
        assert await _read(env, t2) == [5.0] * 8
        del t1, t2


async def test_freed_tensor_is_refused_by_session_and_binding() -> None:
    from _models import chain

    async with aioep.Environment(autoload=False) as env:
        sim = _sim(env)
        mem = sim.memory_info(MemoryType.DEFAULT)
        async with await env.create_session(chain(), [sim]) as sess:
            x = env.empty((3, 4), np.float32, mem)
            x.buffer.free()
            with pytest.raises(InvalidArgument, match="was freed"):
                await sess.run({"x": x})
            binding = sess.io_binding()
            y = env.empty((3, 4), np.float32, mem)
            x2 = env.empty((3, 4), np.float32, mem)
            binding.bind_input("x", x2)
            binding.bind_output("y", y)
            y.buffer.free()
            with pytest.raises(InvalidArgument, match="was freed"):
                await sess.run_with_binding(binding)
            x2.buffer.free()
            with pytest.raises(InvalidArgument, match="was freed"):
                await sess.run_with_binding(binding)
            del x, y, x2, binding


async def test_session_and_binding_refuse_tensors_of_another_environment() -> None:
    from _models import chain

    async with aioep.Environment(autoload=False) as a, aioep.Environment(autoload=False) as b:
        foreign = b.empty((3, 4), np.float32, _sim(b).memory_info(MemoryType.DEFAULT))
        sim = _sim(a)
        async with await a.create_session(chain(), [sim]) as sess:
            with pytest.raises(InvalidArgument, match=r"library 'sim' of Environment #\d+"):
                await sess.run({"x": foreign})
            binding = sess.io_binding()
            with pytest.raises(InvalidArgument, match=r"library 'sim' of Environment #\d+"):
                binding.bind_input("x", foreign)
        del foreign


async def test_module_level_copy_without_the_context() -> None:
    """A task that did not inherit the context (a server's request task) finds the one open
    environment; two open ones are ambiguous; none open is a clear error."""
    empty = contextvars.Context()
    src, dst = np.arange(4.0), np.zeros(4)

    def in_fresh_context() -> aioep.Environment:
        return empty.run(aioep.current_environment)

    with pytest.raises(EpError, match="no aioep Environment is open"):
        in_fresh_context()
    async with aioep.Environment(autoload=False) as env:
        assert in_fresh_context() is env
        assert await anyio.to_thread.run_sync(in_fresh_context) is env
        await empty.run(aioep.copy_tensors, [src], [dst])
        assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]
        async with aioep.Environment(autoload=False) as other:
            assert aioep.current_environment() is other  # the context's wins
            with pytest.raises(EpError, match="2 aioep Environments are open"):
                in_fresh_context()
            with pytest.raises(EpError, match="ambiguous"):
                empty.run(aioep.copy_tensors, [src], [dst])
            # A device tensor names its environment even there.
            t = await _device_tensor(other, _sim(other), 7.0)
            out = np.zeros(8, np.float32)
            await empty.run(aioep.copy_tensors, [t], [out])
            assert out.tolist() == [7.0] * 8
            del t
        assert in_fresh_context() is env
    gc.collect()
    with pytest.raises(EpError, match="no aioep Environment is open"):
        in_fresh_context()


async def test_every_allocated_buffer_knows_its_origin() -> None:
    async with aioep.Environment(autoload=False) as env:
        sim = _sim(env)
        arena = env.create_shared_allocator(sim)
        info = sim.memory_info(MemoryType.DEFAULT)
        assert info is not None
        for t in (env.empty(4, np.float32, info), env.empty(4, np.float32), arena.alloc(8)):
            buffer = t.buffer if isinstance(t, aioep.Tensor) else t
            assert buffer.origin is not None
            assert buffer.origin.scope is env._scope
        assert env.empty(4, np.float32, info).buffer.origin.library == "sim"
        assert env.empty(4, np.float32).buffer.origin.library == "host"
        # Memory aioep did not allocate is producer-owned: no origin, usable anywhere.
        assert aioep.Tensor.from_numpy(np.zeros(2)).buffer.origin is None
        del t, buffer, arena
