"""The environment's shared allocators (ORT's CreateSharedAllocator / GetSharedAllocator /
ReleaseSharedAllocator / RegisterAllocator rules), with a fake GPU library of host memory."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest

import aioep
from aioep import (
    AllocatorType,
    DeviceType,
    EpDevice,
    EpFactory,
    HardwareDevice,
    InUseError,
    InvalidArgument,
    MemoryDevice,
    MemoryInfo,
    MemoryType,
)
from aioep._base.types import HOST_MEMORY_DEVICE
from aioep._environment.host import HostAllocator
from aioep._memory.arena import ArenaAllocator
from aioep._plugin.factory import FactoryOptions

pytestmark = pytest.mark.anyio

FAKE_VENDOR = 0xBE57
FAKE_INFO = MemoryInfo(
    "FakeGpu", MemoryDevice(DeviceType.GPU, MemoryType.DEFAULT, FAKE_VENDOR, 0), alignment=256
)
FAKE_PINNED = MemoryInfo(
    "FakeGpuPinned", MemoryDevice(DeviceType.GPU, MemoryType.HOST_ACCESSIBLE, FAKE_VENDOR, 0)
)


class FakeGpuFactory(EpFactory):
    """A GPU-type device whose memory is host memory underneath (like ORT's example EP)."""

    name = "FakeGpuExecutionProvider"
    vendor = "Contoso"
    vendor_id = FAKE_VENDOR

    def __init__(self, options: FactoryOptions | None = None) -> None:
        self.made: list[HostAllocator] = []
        self.closed = False

    def get_supported_devices(self, hardware: Sequence[HardwareDevice]) -> list[EpDevice]:
        hw = HardwareDevice(DeviceType.GPU, FAKE_VENDOR, 0, "Contoso")
        return [
            EpDevice(
                self,
                hw,
                memory_infos={
                    MemoryType.DEFAULT: FAKE_INFO,
                    MemoryType.HOST_ACCESSIBLE: FAKE_PINNED,
                },
            )
        ]

    def create_allocator(
        self, memory_info: MemoryInfo, options: FactoryOptions | None
    ) -> aioep.Allocator:
        if options:
            raise InvalidArgument(f"fake allocator: unknown option(s) {sorted(options)}")
        allocator = HostAllocator(memory_info)
        self.made.append(allocator)
        return allocator

    def close(self) -> None:
        self.closed = True


class UserAllocator(HostAllocator):
    """A user's own allocator (a different name than the library's)."""


@pytest.fixture
async def env() -> AsyncIterator[aioep.Environment]:
    async with aioep.Environment(autoload=False) as env:
        yield env
        gc.collect()


def fake_device(env: aioep.Environment) -> EpDevice:
    return env.ep_devices(ep_name=FakeGpuFactory.name)[0]


async def test_registration_adds_one_default_allocator_per_memory_info(
    env: aioep.Environment,
) -> None:
    assert env.get_shared_allocator(FAKE_INFO) is None
    factory = FakeGpuFactory()
    env.register_library("fake", factory)
    for info in (FAKE_INFO, FAKE_PINNED):
        allocator = env.get_shared_allocator(info)
        assert allocator is not None
        assert allocator.memory_info == info
        assert allocator.memory_info.allocator_type is AllocatorType.DEVICE
    assert len(factory.made) == 2
    # the lookup ignores the name (ORT's GetSharedAllocator)
    renamed = MemoryInfo("other-name", FAKE_INFO.device)
    assert env.get_shared_allocator(renamed) is env.get_shared_allocator(FAKE_INFO)
    assert env.get_shared_allocator(FAKE_INFO.device) is env.get_shared_allocator(FAKE_INFO)


async def test_cpu_lookup_falls_back_to_the_host_allocator(env: aioep.Environment) -> None:
    # ORT's SharedAllocators.GetSharedAllocator: "Cpu", then the user's "dummy", then "Cpu".
    dummy = MemoryInfo("dummy", HOST_MEMORY_DEVICE)
    host = env.get_shared_allocator(dummy)
    assert host is not None
    assert host.memory_info.name == "Cpu"
    custom = UserAllocator(dummy)
    env.register_allocator(custom)
    assert env.get_shared_allocator(dummy) is custom
    assert env.get_shared_allocator(dummy).memory_info.name == "dummy"  # type: ignore[union-attr]
    env.unregister_allocator(dummy)
    assert env.get_shared_allocator(dummy) is host
    assert not custom.closed  # the user's allocator is theirs to close
    # a non-CPU memory with no allocator is simply None
    bogus = MemoryInfo("Bogus", MemoryDevice(DeviceType.GPU, MemoryType.HOST_ACCESSIBLE, 0xDEAD))
    assert env.get_shared_allocator(bogus) is None
    with pytest.raises(InvalidArgument):
        env.get_shared_allocator("Cpu")  # type: ignore[arg-type]


async def test_create_shared_arena_replaces_the_default(env: aioep.Environment) -> None:
    env.register_library("fake", FakeGpuFactory())
    dev = fake_device(env)
    default = env.get_shared_allocator(FAKE_INFO)
    assert default is not None
    old = default.alloc(1000)
    arena = env.create_shared_allocator(
        dev, MemoryType.DEFAULT, AllocatorType.ARENA, {"arena.initial_chunk_size_bytes": "25600"}
    )
    assert isinstance(arena, ArenaAllocator)
    assert arena.memory_info.allocator_type is AllocatorType.ARENA
    assert arena.memory_info.device == FAKE_INFO.device
    assert env.get_shared_allocator(FAKE_INFO) is arena
    # ORT's AddArenaToSharedAllocator figures
    arena.alloc(16).free()
    stats = arena.stats()
    assert stats["NumAllocs"] == 1
    assert stats["NumArenaExtensions"] == 1
    assert stats["TotalAllocated"] == 25600
    # the replaced allocator keeps serving its live buffer and closes after it
    assert not default.closed
    assert default.live_buffers == 1
    old.free()
    assert default.closed
    t = env.empty((4, 4), "float32", FAKE_INFO)
    assert t.buffer.allocator is arena
    del t
    env.release_shared_allocator(dev, MemoryType.DEFAULT)
    assert env.get_shared_allocator(FAKE_INFO) is None


async def test_create_shared_device_allocator_and_bad_options(env: aioep.Environment) -> None:
    env.register_library("fake", FakeGpuFactory())
    dev = fake_device(env)
    before = env.get_shared_allocator(FAKE_INFO)
    for bad in (
        {"arena.initial_chunk_size_bytes": "not_a_number"},
        {"arena.initial_chunk_size_bytes": "-100"},
        {"arena.max_mem": "abc"},
        {"arena.extend_strategy": "2"},
        {"arena.nope": "1"},
        {"factory_option": "1"},  # the factory rejects what it does not know
    ):
        with pytest.raises(InvalidArgument):
            env.create_shared_allocator(dev, MemoryType.DEFAULT, AllocatorType.ARENA, bad)
        assert env.get_shared_allocator(FAKE_INFO) is before  # unchanged
    with pytest.raises(InvalidArgument, match="ARENA"):
        env.create_shared_allocator(
            dev, MemoryType.DEFAULT, AllocatorType.DEVICE, {"arena.max_mem": "0"}
        )
    plain = env.create_shared_allocator(dev, MemoryType.HOST_ACCESSIBLE, AllocatorType.DEVICE)
    assert not isinstance(plain, ArenaAllocator)
    assert env.get_shared_allocator(FAKE_PINNED) is plain


async def test_memory_type_the_device_lacks_is_invalid(env: aioep.Environment) -> None:
    host_dev = env.ep_devices(device_type=DeviceType.CPU)[0]
    with pytest.raises(InvalidArgument, match="Invalid memory type"):
        env.create_shared_allocator(host_dev, MemoryType.HOST_ACCESSIBLE)
    with pytest.raises(InvalidArgument, match="Invalid memory type"):
        env.release_shared_allocator(host_dev, MemoryType.HOST_ACCESSIBLE)


async def test_release_shared_allocator(env: aioep.Environment) -> None:
    env.register_library("fake", FakeGpuFactory())
    dev = fake_device(env)
    default = env.get_shared_allocator(FAKE_INFO)
    assert default is not None
    env.release_shared_allocator(dev, MemoryType.DEFAULT)
    assert env.get_shared_allocator(FAKE_INFO) is None
    assert default.closed  # nothing was live
    with pytest.raises(InvalidArgument, match="No allocator for this device"):
        env.release_shared_allocator(dev, MemoryType.DEFAULT)
    with pytest.raises(InvalidArgument, match="No shared allocator"):
        env.empty(4, "uint8", FAKE_INFO)
    # creating one again works after a release
    again = env.create_shared_allocator(dev, MemoryType.DEFAULT)
    assert env.get_shared_allocator(FAKE_INFO) is again


async def test_register_allocator_refuses_when_one_exists(env: aioep.Environment) -> None:
    env.register_library("fake", FakeGpuFactory())
    with pytest.raises(InvalidArgument, match="already registered"):
        env.register_allocator(UserAllocator(FAKE_INFO))
    with pytest.raises(InvalidArgument):
        env.register_allocator(object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):  # the library's allocator is not a user's
        env.unregister_allocator(FAKE_INFO)
    user_cpu = UserAllocator(MemoryInfo("mine", HOST_MEMORY_DEVICE))
    env.register_allocator(user_cpu)
    with pytest.raises(InvalidArgument, match="already registered"):
        env.register_allocator(UserAllocator(MemoryInfo("again", HOST_MEMORY_DEVICE)))


async def test_library_registered_after_a_user_allocator_keeps_the_users(
    env: aioep.Environment,
) -> None:
    mine = UserAllocator(MemoryInfo("MyGpuAllocator", FAKE_INFO.device))
    env.register_allocator(mine)
    factory = FakeGpuFactory()
    env.register_library("fake", factory)
    assert env.get_shared_allocator(FAKE_INFO) is mine
    assert len(factory.made) == 1  # only the pinned memory got a default
    buf = env.empty(8, "uint8", FAKE_INFO).buffer
    assert buf.allocator is mine
    del buf
    # unregistering the library leaves the user's allocator in place (names differ)
    env.unregister_library("fake")
    assert env.get_shared_allocator(FAKE_INFO) is mine
    assert env.get_shared_allocator(FAKE_PINNED) is None
    env.unregister_allocator(FAKE_INFO)
    assert env.get_shared_allocator(FAKE_INFO) is None


async def test_unregistering_a_library_removes_its_allocators(env: aioep.Environment) -> None:
    factory = FakeGpuFactory()
    env.register_library("fake", factory)
    dev = fake_device(env)
    arena = env.create_shared_allocator(dev, MemoryType.DEFAULT)
    buf = arena.alloc(1000)
    with pytest.raises(InUseError, match="live buffer"):
        env.unregister_library("fake")
    assert env.get_shared_allocator(FAKE_INFO) is arena  # nothing was removed
    buf.free()
    # the arena still holds its region, but only its own buffers count as live
    env.unregister_library("fake")
    assert env.get_shared_allocator(FAKE_INFO) is None
    assert env.get_shared_allocator(FAKE_PINNED) is None
    assert arena.closed
    assert all(a.closed for a in factory.made)  # the arena's base too
    assert factory.closed
    with pytest.raises(aioep.ClosedError):
        arena.alloc(10)


async def test_factory_closes_after_a_retired_arena_frees_its_last_buffer(
    env: aioep.Environment,
) -> None:
    factory = FakeGpuFactory()
    env.register_library("fake", factory)
    arena = env.create_shared_allocator(fake_device(env), MemoryType.DEFAULT)
    buf = arena.alloc(1000)
    env.release_shared_allocator(fake_device(env), MemoryType.DEFAULT)
    assert not arena.closed  # retired: serves its live buffer
    buf.free()
    assert arena.closed
    assert all(a.closed for a in factory.made if a.memory_info == FAKE_INFO)


async def test_arena_on_a_stream_through_env_empty(env: aioep.Environment) -> None:
    env.register_library("fake", FakeGpuFactory())
    host_dev = env.ep_devices(device_type=DeviceType.CPU)[0]
    arena = env.create_shared_allocator(host_dev, MemoryType.DEFAULT)
    assert env.get_shared_allocator(MemoryInfo("x", HOST_MEMORY_DEVICE)) is arena
    async with host_dev.create_sync_stream() as stream:
        t = env.empty((256,), "float32", arena.memory_info, stream=stream)
        assert t.buffer.stream is stream
        await aioep.copy_tensors([np.ones(256, "float32")], [t], stream=stream)
        assert float(t.numpy().sum()) == 256.0
        del t
