"""A small user program that ``mypy --strict`` checks (tests/session/test_typing.py): a session
from bytes, ``run`` in both forms, and other libraries' tensors (local classes shaped like a
PyTorch tensor and a CuPy array) given to ``copy_tensors``. Each ``reveal_type`` line ends
with a comment naming what the revealed type must contain; none may contain ``Any``.

Never run, only type-checked: ``reveal_type`` is mypy's (ruff does not know it there).
"""

# ruff: noqa: F821

from __future__ import annotations

import enum
from typing import Any

import numpy as np

import aioep


class _DLDeviceType(enum.IntEnum):
    CPU = 1


class TorchLikeTensor:
    """DLPack as PyTorch's ``torch.Tensor`` declares it."""

    def __dlpack__(
        self,
        *,
        stream: Any | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: Any = None,
        copy: bool | None = None,
    ) -> object:
        raise NotImplementedError

    def __dlpack_device__(self) -> tuple[_DLDeviceType, int]:
        return (_DLDeviceType.CPU, 0)


class CupyLikeArray:
    """A CuPy array as Python sees it: ``__cuda_array_interface__`` (version 3)."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


async def main(model: bytes, stream: aioep.SyncStream) -> None:
    async with aioep.Environment() as env:
        session = await env.create_session(model)
        reveal_type(session)  # Session
        feeds = {"x": np.ones(4, np.float32)}
        outputs = await session.run(feeds)
        reveal_type(outputs)  # dict[str, aioep._plugin.tensor.Tensor |
        on_stream = await session.run(feeds, stream, output_location="host")
        reveal_type(on_stream)  # dict[str, aioep._plugin.tensor.Tensor |
        arrays = await session.run(None, feeds)
        reveal_type(arrays)  # list[numpy.ndarray[
        named = await session.run(output_names=["y"], input_feed=feeds, run_options=None)
        reveal_type(named)  # list[numpy.ndarray[
        reveal_type(await session.run(("y",), feeds, stream=stream))  # list[numpy.ndarray[
        y = outputs["y"]
        if isinstance(y, aioep.Tensor):
            print(y.numpy().sum())
        future = aioep.copy_tensors([TorchLikeTensor()], [np.empty(4, np.float32)])
        reveal_type(future)  # CopyFuture
        reveal_type(await future)  # list[aioep._plugin.tensor.Tensor]
        reveal_type(env.copy_tensors([CupyLikeArray()], [np.empty(4, np.float32)]))  # CopyFuture
        reveal_type(session.get_inputs())  # list[aioep._session.node_arg.NodeArg]
        reveal_type(session.get_outputs()[0].shape)  # list[int | str | None]
        await session.aclose()
