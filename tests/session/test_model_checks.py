"""What ``create_session`` takes (a path, bytes, a ModelProto) and what it refuses before
anything runs, whichever EP would run the model: malformed initializers, an opset the
installed onnxruntime does not know."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _baseline import ort_baseline  # noqa: E402
from _models import add_model, chain, model_of, value_info  # noqa: E402
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as h  # noqa: E402
from test_session import sim_environment  # noqa: E402

from aioep import ErrorCode, InvalidArgument  # noqa: E402

pytestmark = pytest.mark.anyio

SIM = "SimExecutionProvider"


@pytest.mark.parametrize("on_sim", [False, True])
async def test_a_model_as_bytes_runs_as_from_a_path_or_a_proto(
    on_sim: bool, tmp_path: Path
) -> None:
    model = chain()
    path = tmp_path / "chain.onnx"
    onnx.save(model, path)
    feeds = {"x": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}
    want = ort_baseline(model).run(None, feeds)
    async with sim_environment() as (env, sims):
        for source in (model.SerializeToString(), model, path, str(path)):
            async with await env.create_session(source, sims[:1] if on_sim else []) as sess:
                assert (SIM in sess.assignment) is on_sim
                got = await sess.run(None, feeds)
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


async def test_what_is_not_a_model_is_invalid_argument() -> None:
    async with sim_environment() as (env, _):
        with pytest.raises(InvalidArgument, match="bytes given are not a serialized ONNX model"):
            await env.create_session(b"\x08\x07\xff\xff not a model")
        for bad in (bytearray(add_model().SerializeToString()), 42):
            with pytest.raises(InvalidArgument, match=r"path, its bytes or an onnx\.ModelProto"):
                await env.create_session(bad)  # type: ignore[arg-type]


def _model_with_w(data_type: int, dims: list[int]) -> Any:
    w = onnx.TensorProto(name="w", data_type=data_type, dims=dims, raw_data=b"\0" * 16)
    return model_of(
        [h.make_node("Add", ["x", "w"], ["y"])], [value_info("x", [4])], [value_info("y", [4])], [w]
    )


@pytest.mark.parametrize("on_sim", [False, True])
@pytest.mark.parametrize(
    ("data_type", "dims", "match"),
    [
        (0, [4], "data type 0"),
        (99, [4], "data type 99"),
        (TP.FLOAT, [-4], "negative dimension"),
    ],
)
async def test_a_malformed_initializer_is_refused_whichever_ep_claims_it(
    on_sim: bool, data_type: int, dims: list[int], match: str
) -> None:
    # Before: a KeyError out of the graph view (unknown type); dims [-4] ran on the sim.
    async with sim_environment() as (env, sims):
        with pytest.raises(InvalidArgument, match=match) as caught:
            await env.create_session(_model_with_w(data_type, dims), sims[:1] if on_sim else [])
        assert caught.value.code is ErrorCode.INVALID_PROTOBUF
        assert "initializer 'w'" in str(caught.value)


@pytest.mark.parametrize("on_sim", [False, True])
async def test_an_opset_newer_than_onnxruntime_is_refused_whichever_ep_claims_it(
    on_sim: bool,
) -> None:
    model = add_model()
    model.opset_import[0].version = 99999
    async with sim_environment() as (env, sims):
        # Before: the sim claimed every node and the model ran.
        with pytest.raises(InvalidArgument, match=r"ai\.onnx opset 99999; the installed onnxr"):
            await env.create_session(model, sims[:1] if on_sim else [])
        model.opset_import[0].version = 17
        async with await env.create_session(model, sims[:1] if on_sim else []) as sess:
            assert (sess.assignment == (SIM,)) is on_sim
