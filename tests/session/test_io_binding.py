"""Pre-bound session I/O (``session.io_binding()``, ``await session.run_with_binding(...)``):
checked at bind time, reused across runs, outputs written into bound tensors or put in bound
memory; on the sim device and (device-resident, through ORT's IOBinding) on WebGPU."""

from __future__ import annotations

import gc

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("aioep_sim")

from _models import chain, reference

import aioep
from aioep import InvalidArgument, MemoryType

pytestmark = pytest.mark.anyio


async def test_bound_inputs_and_outputs_across_runs() -> None:
    async with aioep.Environment(autoload=False) as env:
        (sim, *_) = env.register_library("sim", "aioep_sim:SimFactory")
        mem = sim.memory_info(MemoryType.DEFAULT)
        async with await env.create_session(chain(), [sim]) as sess:
            binding = sess.io_binding()
            x_dev = env.empty((3, 4), np.float32, mem)
            y_dev = env.empty((3, 4), np.float32, mem)
            binding.bind_input("x", x_dev)
            binding.bind_output("y", y_dev)  # written in place on the device
            binding.bind_output("c", aioep.abc.HOST_MEMORY_INFO)  # put on the host
            rng = np.random.default_rng(3)
            for _ in range(3):
                x = rng.standard_normal((3, 4)).astype(np.float32)
                await aioep.copy_tensors([x], [x_dev])
                out = await sess.run_with_binding(binding)
                assert out["y"] is y_dev
                assert out["c"].is_host_accessible
                want = reference(chain(), {"x": x})
                y = np.empty((3, 4), np.float32)
                await aioep.copy_tensors([y_dev], [y])
                np.testing.assert_allclose(y, want["y"], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(out["c"].numpy(), want["c"], rtol=1e-5, atol=1e-6)
                assert binding.get_outputs().keys() == {"y", "c"}
            # A host numpy input works too, and a stream orders everything on it.
            binding.bind_input("x", np.ones((3, 4), np.float32))
            async with env.create_sync_stream(sim) as stream:
                out = await sess.run_with_binding(binding, stream)
                y = np.empty((3, 4), np.float32)
                await aioep.copy_tensors([y_dev], [y], stream)
            want = reference(chain(), {"x": np.ones((3, 4), np.float32)})
            np.testing.assert_allclose(y, want["y"], rtol=1e-5, atol=1e-6)
            del out, x_dev, y_dev, binding


async def test_bad_binds_are_invalid_argument_and_change_nothing() -> None:
    async with aioep.Environment(autoload=False) as env:
        (sim, *_) = env.register_library("sim", "aioep_sim:SimFactory")
        mem = sim.memory_info(MemoryType.DEFAULT)
        async with await env.create_session(chain(), [sim]) as sess:
            binding = sess.io_binding()
            good = np.zeros((3, 4), np.float32)
            binding.bind_input("x", good)
            with pytest.raises(InvalidArgument, match=r"unknown input 'nope'.*\['x'\]"):
                binding.bind_input("nope", good)
            with pytest.raises(InvalidArgument, match="dtype float64, the model expects float32"):
                binding.bind_input("x", np.zeros((3, 4)))
            with pytest.raises(
                InvalidArgument, match=r"shape \(4, 3\), the model expects \[3, 4\]"
            ):
                binding.bind_input("x", np.zeros((4, 3), np.float32))
            with pytest.raises(InvalidArgument, match=r"aioep\.Tensor or a numpy array"):
                binding.bind_input("x", [[0.0] * 4] * 3)
            freed = env.empty((3, 4), np.float32, mem)
            freed.buffer.free()
            with pytest.raises(InvalidArgument, match="was freed"):
                binding.bind_input("x", freed)
            with pytest.raises(InvalidArgument, match="unknown output 'z'"):
                binding.bind_output("z", good)
            ro = np.zeros((3, 4), np.float32)
            ro.flags.writeable = False
            with pytest.raises(InvalidArgument, match="read-only"):
                binding.bind_output("y", aioep.Tensor.from_numpy(ro))
            other_info = aioep.MemoryInfo(
                "nowhere", aioep.MemoryDevice(aioep.DeviceType.NPU, MemoryType.DEFAULT, 7, 0)
            )
            with pytest.raises(InvalidArgument, match="no allocator for 'nowhere'"):
                binding.bind_output("y", other_info)
            assert binding.inputs["x"].numpy() is not None  # the good bind is still there
            assert binding.outputs == {}
            with pytest.raises(InvalidArgument, match="not an IOBinding of this session"):
                await sess.run_with_binding(object())  # type: ignore[arg-type]
            async with await env.create_session(chain(), [sim]) as other:
                with pytest.raises(InvalidArgument, match="not an IOBinding of this session"):
                    await other.run_with_binding(binding)
            binding.clear_binding_inputs()
            with pytest.raises(InvalidArgument, match=r"input\(s\) \['x'\] are not bound"):
                await sess.run_with_binding(binding)
            del freed


async def test_tensors_of_another_environment_are_refused() -> None:
    async with (
        aioep.Environment(autoload=False) as env_a,
        aioep.Environment(autoload=False) as env_b,
    ):
        (sim_a, *_) = env_a.register_library("sim", "aioep_sim:SimFactory")
        (sim_b, *_) = env_b.register_library("sim", "aioep_sim:SimFactory")
        foreign = env_b.empty((3, 4), np.float32, sim_b.memory_info(MemoryType.DEFAULT))
        async with await env_a.create_session(chain(), [sim_a]) as sess:
            binding = sess.io_binding()
            with pytest.raises(InvalidArgument, match="another environment"):
                binding.bind_input("x", foreign)
            with pytest.raises(InvalidArgument, match="another environment"):
                binding.bind_output("y", foreign)
        del foreign
        gc.collect()


async def test_memory_no_transfer_reaches_is_refused_at_bind_time() -> None:
    """A tensor in memory that no data transfer of the environment can move to where the
    session reads the input is refused when bound, not when the run starts."""
    from _factories import FakeGpuFactory

    async with aioep.Environment(autoload=False) as env:
        (sim, *_) = env.register_library("sim", "aioep_sim:SimFactory")
        # The fake GPU's transfer copies only between its memory and the host.
        (fake,) = env.register_library("fake", FakeGpuFactory)
        async with await env.create_session(chain(), [sim]) as sess:
            binding = sess.io_binding()
            elsewhere = env.empty((3, 4), np.float32, fake.memory_info(MemoryType.DEFAULT))
            with pytest.raises(InvalidArgument, match="no data transfer of this environment"):
                binding.bind_input("x", elsewhere)
            del elsewhere


async def test_output_shape_that_does_not_fit_the_bound_tensor() -> None:
    from onnx import TensorProto, helper

    vi_x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    vi_y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [vi_x], [vi_y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    async with aioep.Environment(autoload=False) as env:
        (sim, *_) = env.register_library("sim", "aioep_sim:SimFactory")
        async with await env.create_session(model, [sim]) as sess:
            binding = sess.io_binding()
            binding.bind_input("x", np.ones(5, np.float32))
            out = np.zeros(4, np.float32)
            binding.bind_output("y", out)  # fine at bind time: the model's n is dynamic
            with pytest.raises(InvalidArgument, match=r"shape \(5,\).*bound to it is \(4,\)"):
                await sess.run_with_binding(binding)
            binding.bind_output("y", np.zeros(5, np.float32))
            res = await sess.run_with_binding(binding)
            np.testing.assert_array_equal(res["y"].numpy(), np.ones(5, np.float32))


def _webgpu_path() -> str:
    import importlib.util

    from _webgpu import webgpu_skip_reason

    if importlib.util.find_spec("aioep_ort") is None:
        pytest.skip("the ort backend is not installed")
    reason = webgpu_skip_reason()
    if reason:
        pytest.skip(reason)
    import onnxruntime_ep_webgpu  # type: ignore[import-untyped]

    return str(onnxruntime_ep_webgpu.get_library_path())


@pytest.mark.parametrize(("dim", "copies_into_y"), [(4, 0), ("n", 1)])
async def test_webgpu_binding_stays_on_the_device(
    monkeypatch: pytest.MonkeyPatch, dim: int | str, copies_into_y: int
) -> None:
    """On the WebGPU plugin EP a bound device input is read where it is. A bound device
    output of a fixed shape is written by ORT where it is (no ORT copy at all); one whose
    shape the model leaves open is not handed to ORT as a buffer (a different size would
    fail inside ORT): ORT allocates it and the session copies it in, checking the shape."""
    path = _webgpu_path()
    from _models import add_model
    from _webgpu import OrtCopies

    copies = OrtCopies(monkeypatch)
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", path)
        mem = dev.memory_info(MemoryType.DEFAULT)
        async with await env.create_session(add_model(dim), [dev]) as sess:
            binding = sess.io_binding()
            x = env.empty((4,), "float32", mem)
            y = env.empty((4,), "float32", mem)
            await aioep.copy_tensors([np.arange(4, dtype=np.float32)], [x])
            binding.bind_input("x", x)
            binding.bind_output("y", y)
            before = copies.calls
            out = await sess.run_with_binding(binding)
            assert copies.calls - before == copies_into_y
            assert out["y"] is y
            back = np.zeros(4, np.float32)
            await aioep.copy_tensors([y], [back])
            np.testing.assert_array_equal(back, [0, 2, 4, 6])
            binding.bind_output("y", aioep.abc.HOST_MEMORY_INFO)
            out = await sess.run_with_binding(binding)
            np.testing.assert_array_equal(out["y"].numpy(), [0, 2, 4, 6])
            if isinstance(dim, str):
                binding.bind_output("y", env.empty((5,), "float32", mem))
                with pytest.raises(InvalidArgument, match=r"shape \(4,\).*bound to it is \(5,\)"):
                    await sess.run_with_binding(binding)
            del x, y, out, binding
