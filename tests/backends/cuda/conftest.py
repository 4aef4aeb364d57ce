"""Fixtures shared by the CUDA backend's tests.

They run on the driver that `cuda_emulator.select_driver` chose, once per process: the
real NVIDIA driver where ``cuInit`` finds a GPU, else the emulated driver of
``tests/cuda_emulator`` (a test double). On the emulator, every test marked ``gpu`` gets its
devices, its thread (the event loop) watched for waits in the driver, and a check that the
emulator saw no violation. A test function may set ``emulated_devices`` (how many devices)
and ``loop_may_wait`` (a documented path where the caller's thread waits in the driver).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cuda_emulator import Driver, select_driver

DRIVER = select_driver()


@pytest.fixture(autouse=True)
def cuda_driver(request: pytest.FixtureRequest) -> Iterator[Driver]:
    """For a gpu test on the emulator: offer its devices for the test, watch the test's thread
    (the event loop) for blocking driver calls, and fail the test if the emulator saw work
    touch freed memory or run out of order."""
    emulator = DRIVER.emulator
    if emulator is None or request.node.get_closest_marker("gpu") is None:
        yield DRIVER
        return
    emulator.take_violation()
    with contextlib.ExitStack() as marked:
        if not getattr(request.function, "loop_may_wait", False):
            # The test's thread runs the event loop: the emulator aborts if it ever has to
            # wait in the driver (for the device, or behind another thread's synchronisation).
            marked.enter_context(emulator.loop_thread())
        yield from _emulated(request, emulator)


@pytest.fixture
def join_releases() -> Callable[[], None]:
    """The function that waits (bounded) for the CUDA backend's release threads."""
    return _join_releases


def _emulated(request: pytest.FixtureRequest, emulator: Any) -> Iterator[Driver]:
    with emulator.devices(getattr(request.function, "emulated_devices", 1)):
        emulator.set("watch_tid", threading.get_native_id())
        emulator.set("host_wait_limit_ns", 20_000_000_000)  # a hung wait fails, never hangs
        blocked = emulator.get("watched_blocking")
        yield DRIVER
        gc.collect()
        blocked = emulator.get("watched_blocking") - blocked
        _join_releases()
        device = sys.modules.get("aioep_cuda._device")
        if device is not None and device._registry:  # a failed test still holds memory: the
            device._registry.clear()  # emulator destroys its context, so forget it here
    violation = emulator.take_violation()
    if violation:
        pytest.fail(f"the CUDA emulator saw a violation: {violation}")
    if blocked and not getattr(request.function, "loop_may_wait", False):
        pytest.fail(f"the event-loop thread waited in the CUDA driver {blocked} time(s)")


def _join_releases() -> None:
    """Wait (bounded) for shared device states being released on their own thread (memory
    that outlived its environment came back): then no context is retained any more."""
    for thread in threading.enumerate():
        if thread.name == "aioep-cuda-release":
            thread.join(20)
