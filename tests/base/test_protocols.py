"""The public protocols of other libraries' tensors hold at run time too (``isinstance``), for
the objects aioep takes: numpy arrays and DLPack producers, CUDA Array Interface objects."""

from __future__ import annotations

from typing import Any

import numpy as np

import aioep


class _CudaArrayLike:
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (1,), "typestr": "<f4", "data": (0, False), "version": 3}


def test_protocols_recognise_producers() -> None:
    array = np.ones(3, np.float32)
    assert isinstance(array, aioep.SupportsDLPack)
    assert isinstance(aioep.Tensor.from_numpy(array), aioep.SupportsDLPack)
    assert not isinstance(array, aioep.SupportsCudaArrayInterface)
    assert isinstance(_CudaArrayLike(), aioep.SupportsCudaArrayInterface)
    assert not isinstance(_CudaArrayLike(), aioep.SupportsDLPack)
    assert not isinstance([1.0, 2.0], aioep.SupportsDLPack)
