"""ONNX's backend conformance suite (``onnx.backend.test``) through ``aioep.onnx_backend``.

Each case runs with ONNX's own runner (``onnx.backend.test.BackendTest``) twice: on plain
onnxruntime (an ``InferenceSession`` on the CPU EP, the model's IR version capped to what
the installed onnxruntime loads, as aioep caps it) and through an aioep backend. Where
onnxruntime passes, aioep must pass. Where onnxruntime fails, the case is an expected
failure carrying onnxruntime's error: an aioep failure shows as XFAIL, an aioep pass as
XPASS. Which cases onnxruntime passes is decided here, at run time, by the installed
onnx and onnxruntime, so a release that fixes a case makes it one aioep must pass.

Backends: the sim device (``aioep.onnx_backend`` as configured by default), and the
WebGPU plugin EP through the ort backend, whose outputs must match onnxruntime's CPU
results within the suite's tolerances (skipped where no WebGPU adapter works).

By default a deterministic sample runs: the node cases of the ops listed in
``SIM_SAMPLE``/``WEBGPU_SAMPLE`` (every case of an op, or an evenly spaced subset of a
large one, plus the cases in ``PINNED``), some model cases, and the small light models.
``AIOEP_CONFORMANCE_FULL=1`` runs every case instead (marker ``conformance_full``).

Tolerances are the suite's, except that cases with float16 outputs are compared to two
float16 ULPs (``rtol >= 2**-9``), the rule ONNX's runner applies to bfloat16: fp16
results differ by an ULP or two with the order of accumulation (onnxruntime's own
kernels differ from a float32 accumulation).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import unittest
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar
from unittest import mock

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import onnx.backend.test.case.node as node_cases  # noqa: E402
import onnx.backend.test.runner as onnx_runner  # noqa: E402
from onnx.backend.base import Backend, BackendRep  # noqa: E402
from onnx.backend.test.case.test_case import TestCase  # noqa: E402
from onnx.backend.test.loader import load_model_tests  # noqa: E402

import aioep.onnx_backend  # noqa: E402
from aioep._graph.ort_compat import ort_limits  # noqa: E402
from aioep.onnx_backend import AioepBackend  # noqa: E402

os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")

FULL = os.environ.get("AIOEP_CONFORMANCE_FULL", "") not in ("", "0")
MODEL_KINDS = ("simple", "pytorch-converted", "pytorch-operator", "real")

# -- the sample --------------------------------------------------------------------------------
# ONNX's node-case modules (onnx.backend.test.case.node.<module>) and how many of each
# module's cases to take (None: all; n: n evenly spaced). Modules an onnx release lacks are
# skipped. The first group covers what the issue found broken; the rest is a spread of ops.
SIM_SAMPLE: dict[str, int | None] = {
    # 0-d (scalar) inputs and outputs
    "det": None,
    "einsum": None,
    "bitcast": None,
    "gemm": None,
    "rangeop": None,
    "blackmanwindow": None,
    "hannwindow": None,
    "size": None,
    "dynamicquantizelinear": None,
    "negativeloglikelihoodloss": 6,
    "softmax_cross_entropy_loss": 6,
    # partitions that start from constants (the *_expanded function bodies)
    "attention": 10,
    "rotaryembedding": 4,
    "linear_attention": 4,
    # zero-size tensors on the sim device
    "reducel1": 4,
    "reducesumsquare": 4,
    # string tensors
    "string_concat": None,
    "string_split": None,
    "stringnormalizer": None,
    "regex_full_match": None,
    # sequences and optionals
    "identity": None,
    "if_": None,
    "loop": None,
    "splittosequence": None,
    "sequence_map": 4,
    "sequenceinsert": None,
    "optionalgetelement": None,
    "optionalhaselement": None,
    # what the sim EP runs
    "add": None,
    "sub": 4,
    "mul": 4,
    "matmul": None,
    "relu": None,
    "sigmoid": None,
    "tanh": None,
    "abs": None,
    "neg": None,
    # a spread of the rest
    "clip": 4,
    "conv": 3,
    "softmax": 4,
    "transpose": 2,
    "reshape": 2,
    "concat": 2,
    "gather": 2,
    "cast": 4,
    "where": None,
    "layernormalization": 4,
    "resize": 3,
    "topk": 2,
    "unique": 2,
    "cumsum": 2,
    "pad": 2,
    "slice": 2,
    "split": 2,
    "lstm": 1,
    "scan": 2,
}
WEBGPU_SAMPLE: dict[str, int | None] = {
    **SIM_SAMPLE,
    "gelu": None,
    "hardsigmoid": 2,
    "leakyrelu": 2,
    "batch_normalization": 2,
    "instance_normalization": None,
    "globalaveragepool": None,
    "div": 4,
    "pow": 4,
    "exp": None,
    "sqrt": None,
    "reducemean": 4,
    "reducemax": 4,
    "argmax": 4,
    "expand": None,
    "tile": None,
    "unsqueeze": 3,
    "squeeze": None,
    "flatten": 3,
    "depthtospace": 2,
    "convtranspose": 2,
    "gathernd": 2,
    "scatternd": 2,
    "trilu": 3,
    "equal": 2,
    "less": 2,
    "not_": None,
    "erf": None,
}
# Cases named in the issue: always in the sample (where the installed onnx has them).
PINNED = frozenset(
    {
        "test_det_2d",
        "test_einsum_scalar",
        "test_bitcast_scalar_float32_to_int32",
        "test_gemm_default_scalar_bias",
        "test_range_float_type_positive_delta_expanded",
        "test_range_int32_type_negative_delta_expanded",
        "test_blackmanwindow_expanded",
        "test_hannwindow_symmetric_expanded",
        "test_nllloss_NCd1d2_reduction_mean",
        "test_sce_mean",
        "test_attention_4d_expanded",
        "test_attention_4d_causal_fp16_expanded",
        "test_rotary_embedding_expanded",
        "test_linear_attention_linear_expanded",
        "test_reduce_l1_empty_set_expanded",
        "test_reduce_sum_square_empty_set_expanded",
        "test_split_to_sequence_1",
        "test_split_to_sequence_nokeepdims",
        "test_identity_opt",
        "test_loop16_seq_none",
        "test_if_seq",
        "test_if_opt",
        "test_sequence_map_identity_2_sequences",
    }
)
# Model cases (directories in the onnx wheel): simple holds the sequence and string models.
SIM_MODELS = {"simple": None, "pytorch-converted": 6, "pytorch-operator": 6, "real": 0}
WEBGPU_MODELS = {"simple": 0, "pytorch-converted": 6, "pytorch-operator": 0, "real": 0}
LIGHT_MODELS = {"sim": ("test_squeezenet",), "webgpu": ("test_squeezenet",)}
FP16_RTOL = 2**-9  # two float16 ULPs


def _spaced(items: Sequence[TestCase], count: int | None) -> list[TestCase]:
    if count is None or count >= len(items):
        return list(items)
    if count <= 0:
        return []
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


@functools.cache
def _module_cases(module: str) -> tuple[TestCase, ...]:
    """The node cases one of ONNX's case modules makes (generated when it is imported)."""
    name = f"{node_cases.__name__}.{module}"
    if importlib.util.find_spec(name) is None:
        return ()
    start = len(node_cases._NodeTestCases)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators overflow casts on purpose
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)
    return tuple(node_cases._NodeTestCases[start:])


# Whether ONNX's runner runs a generated case from its in-memory model (onnx >= 1.18).
_RUNS_IN_MEMORY = "data_sets" in inspect.getsource(onnx_runner.Runner._add_model_test)


@functools.cache
def _all_node_cases() -> tuple[TestCase, ...]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tuple(load_model_tests(kind="node"))


def _local(case: TestCase) -> bool:
    """A model case the runner reads from the wheel (the light models)."""
    return bool(case.url) and case.url.startswith("onnx/backend/test/data/light/")


@functools.cache
def _model_cases(kind: str) -> tuple[TestCase, ...]:
    # Only cases whose data the onnx wheel holds: older wheels (onnx < 1.18) list the "real"
    # models as URLs, and ONNX's runner would download them, retrying with sleeps (CI has
    # no network: minutes lost per case, and nothing to compare).
    cases = (c for c in load_model_tests(kind=kind) if c.model_dir is not None or _local(c))
    return tuple(sorted(cases, key=lambda c: c.name))


def _sample(target: str) -> dict[str, list[TestCase]]:
    """Kind -> cases for ``target`` ("sim" or "webgpu")."""
    if FULL:
        return {"node": list(_all_node_cases()), **{k: list(_model_cases(k)) for k in MODEL_KINDS}}
    modules = SIM_SAMPLE if target == "sim" else WEBGPU_SAMPLE
    # Before onnx 1.18 ONNX's runner cannot run a generated (in-memory) case, and would try
    # to download it instead: take the wheel's stored copy of the case there.
    stored = {} if _RUNS_IN_MEMORY else {c.name: c for c in _all_node_cases()}
    nodes: list[TestCase] = []
    for module, count in modules.items():
        cases = _module_cases(module)
        picked = {c.name for c in _spaced(cases, count)}
        for case in cases:
            if case.name in picked or case.name in PINNED:
                case = stored.get(case.name, case)
                if case.model_dir is not None or _RUNS_IN_MEMORY:
                    nodes.append(case)
    models = SIM_MODELS if target == "sim" else WEBGPU_MODELS
    out = {"node": nodes}
    for kind, count in models.items():
        cases = list(_model_cases(kind))
        chosen = _spaced(cases, count)
        if kind == "real":
            chosen = [c for c in cases if c.name in LIGHT_MODELS[target]]
        out[kind] = chosen
    return out


# -- the runners ------------------------------------------------------------------------------
def _assert_similar(
    ref_outputs: Sequence[Any], outputs: Sequence[Any], rtol: float, atol: float, model_dir: Any
) -> None:
    """ONNX's comparison, float16 outputs to two float16 ULPs."""
    if any(isinstance(r, np.ndarray) and r.dtype == np.float16 for r in ref_outputs):
        rtol = max(rtol, FP16_RTOL)
    # Called on ONNX's class, so its recursion into sequences stays ONNX's own.
    onnx_runner.Runner.assert_similar_outputs(ref_outputs, outputs, rtol, atol, model_dir)


class _Runner(onnx_runner.Runner):
    """ONNX's runner; the comparison is `_assert_similar`."""

    @classmethod
    def assert_similar_outputs(
        cls,
        ref_outputs: Sequence[Any],
        outputs: Sequence[Any],
        rtol: float,
        atol: float,
        model_dir: str | None = None,
    ) -> None:
        _assert_similar(ref_outputs, outputs, rtol, atol, model_dir)


def _runner(
    backend: Any, cases: dict[str, list[TestCase]], runner_class: type[_Runner] = _Runner
) -> dict[str, Callable[[], None]]:
    """Case name -> a callable running it with ONNX's runner (the runner's own loader
    replaced by ``cases``)."""

    def load(data_dir: str = "", kind: str | None = None) -> list[TestCase]:
        return list(cases.get(kind or "", ()))

    with mock.patch.object(onnx_runner, "load_model_tests", load):
        runner = runner_class(backend, __name__)
    tests: dict[str, Callable[[], None]] = {}
    for cls in runner.test_cases.values():
        for attr in dir(cls):
            if attr.startswith("test_") and attr.endswith("_cpu"):
                tests[attr.removesuffix("_cpu")] = getattr(cls(attr), attr)
    return tests


class _OrtRep(BackendRep):
    def __init__(self, session: Any) -> None:
        self._session = session
        self._names = [i.name for i in session.get_inputs()]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        # ONNX's node cases give some scalars as numpy scalars, which onnxruntime's binding
        # refuses ("Unable to handle object of type numpy.float32"): hand it arrays.
        feeds = {
            n: np.asarray(v) if isinstance(v, np.generic) else v
            for n, v in zip(self._names, inputs)
        }
        return tuple(self._session.run(None, feeds))


class PlainOrt(Backend):
    """The baseline: an onnxruntime ``InferenceSession`` on the CPU EP, IR version capped."""

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> _OrtRep:
        limits = ort_limits()
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        if limits is not None:
            copy.ir_version = min(copy.ir_version, limits.max_ir_version)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        session = ort.InferenceSession(
            copy.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
        return _OrtRep(session)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


_RECORDED: list[list[Any]] = []


class _RecordingRep(_OrtRep):
    """Keeps onnxruntime's outputs: the WebGPU check compares aioep's with them."""

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        outputs = super().run(inputs, **kwargs)
        _RECORDED.append(list(outputs))
        return outputs


class RecordingOrt(PlainOrt):
    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> _OrtRep:
        rep = PlainOrt.prepare(model, device, **kwargs)
        return _RecordingRep(rep._session)


class _AgainstCpu(_Runner):
    """Compares outputs with onnxruntime's CPU outputs of the same case (``reference``,
    one list per data set) instead of the stored ones."""

    reference: ClassVar[list[list[Any]]] = []

    @classmethod
    def assert_similar_outputs(
        cls,
        ref_outputs: Sequence[Any],
        outputs: Sequence[Any],
        rtol: float,
        atol: float,
        model_dir: str | None = None,
    ) -> None:
        assert cls.reference, "onnxruntime produced no outputs for this data set"
        _assert_similar(cls.reference.pop(0), outputs, rtol, atol, model_dir)


# -- WebGPU -----------------------------------------------------------------------------------
_PROBE = """
import numpy as np, onnxruntime as ort, onnxruntime_ep_webgpu as w
ort.register_execution_provider_library("probe", w.get_library_path())
dev = next(d for d in ort.get_ep_devices() if d.ep_name == w.get_ep_name())
v = ort.OrtValue.ortvalue_from_shape_and_type((4,), np.uint8,
        memory_info=dev.memory_info(ort.OrtDeviceMemoryType.DEFAULT))
h = np.zeros(4, np.uint8)
ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(np.arange(4, dtype=np.uint8))], [v], None)
ort.copy_tensors([v], [ort.OrtValue.ortvalue_from_numpy(h)], None)
assert list(h) == [0, 1, 2, 3]
"""


@functools.cache
def _webgpu_library() -> str | None:
    """The WebGPU plugin library where a WebGPU adapter works, else None."""
    if importlib.util.find_spec("onnxruntime_ep_webgpu") is None:
        return None
    if importlib.util.find_spec("aioep_ort") is None:
        return None
    # In a child: with no usable adapter the first device allocation aborts the process.
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=120)
    if proc.returncode != 0:
        return None
    import onnxruntime_ep_webgpu  # type: ignore[import-untyped]

    return str(onnxruntime_ep_webgpu.get_library_path())


@functools.cache
def _webgpu_backend() -> type[AioepBackend]:
    path = _webgpu_library()
    assert path is not None
    return AioepBackend.configure(
        ep_devices=["WebGpuExecutionProvider"],
        environment_options={
            "backends": ["ort"],
            "backend_options": {"ort": {"libraries": f"webgpu={path}"}},
        },
        name="WebGpuBackend",
    )


# -- the tests --------------------------------------------------------------------------------
_RESULTS: dict[str, dict[str, tuple[bool, bool]]] = {"sim": {}, "webgpu": {}}


def _names(target: str) -> list[Any]:
    marks = [pytest.mark.conformance_full] if FULL else []
    names = sorted({c.name for cases in _sample(target).values() for c in cases})
    return [pytest.param(n, marks=marks, id=n) for n in names]


@functools.cache
def _sim_tests(kind: str) -> dict[str, Callable[[], None]]:
    backend: Any = aioep.onnx_backend if kind == "aioep" else PlainOrt
    return _runner(backend, _sample("sim"))


def _outcome(test: Callable[[], None]) -> str | None:
    """None when the case passes, else what went wrong."""
    try:
        test()
    except unittest.SkipTest as exc:
        pytest.skip(str(exc))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first[:300]}"
    return None


@pytest.fixture(scope="module", autouse=True)
def _setup(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[None]:
    # The runner writes the light models' generated inputs under $ONNX_HOME.
    with mock.patch.dict(os.environ, {"ONNX_HOME": str(tmp_path_factory.mktemp("onnx_home"))}):
        yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    for target, results in _RESULTS.items():
        if not results or reporter is None:
            continue
        ort_ok = sum(o for o, _ in results.values())
        both = sum(o and a for o, a in results.values())
        extra = sum(a and not o for o, a in results.values())
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            reporter.write_line(
                f"\nONNX conformance ({target}): {len(results)} cases; onnxruntime passes "
                f"{ort_ok}; aioep passes {both} of those, and {extra} that onnxruntime fails"
            )
    AioepBackend.close()
    if _webgpu_library() is not None:
        _webgpu_backend().close()


def _expect(request: pytest.FixtureRequest, ort_error: str | None) -> None:
    if ort_error is not None:
        request.applymarker(
            pytest.mark.xfail(reason=f"onnxruntime fails too: {ort_error}", strict=False)
        )


@pytest.mark.parametrize("name", _names("sim"))
def test_sim(name: str, request: pytest.FixtureRequest) -> None:
    """The case through aioep on the sim device: it passes wherever onnxruntime passes."""
    ort_error = _outcome(_sim_tests("ort")[name])
    _expect(request, ort_error)
    error = _outcome(_sim_tests("aioep")[name])
    _RESULTS["sim"][name] = (ort_error is None, error is None)
    assert error is None, error


class PlainWebGpu(PlainOrt):
    """onnxruntime with the WebGPU plugin EP selected, without aioep: tells the EP's own
    limits (ops or attributes it refuses, its numerics) from aioep's."""

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> _OrtRep:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        limits = ort_limits()
        if limits is not None:
            copy.ir_version = min(copy.ir_version, limits.max_ir_version)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        # The library is registered with onnxruntime by aioep's environment (opened first).
        devices = [d for d in ort.get_ep_devices() if d.ep_name == "WebGpuExecutionProvider"]
        so.add_provider_for_devices(devices, {})
        return _OrtRep(ort.InferenceSession(copy.SerializeToString(), so))


@functools.cache
def _webgpu_tests(kind: str) -> dict[str, Callable[[], None]]:
    if kind == "ort":
        return _runner(RecordingOrt, _sample("webgpu"))
    if kind == "plain":
        return _runner(PlainWebGpu, _sample("webgpu"), _AgainstCpu)
    return _runner(_webgpu_backend(), _sample("webgpu"), _AgainstCpu)


@pytest.mark.parametrize("name", _names("webgpu"))
def test_webgpu(name: str, request: pytest.FixtureRequest) -> None:
    """The case through aioep on the WebGPU plugin EP: its outputs match onnxruntime's CPU
    results within the suite's tolerances (an expected failure where onnxruntime's CPU EP
    cannot run it, or onnxruntime with the WebGPU EP fails it without aioep)."""
    if _webgpu_library() is None:
        pytest.skip(
            "no working WebGPU plugin EP (pip install -e 'backends/ort[webgpu]', "
            ".ci/install-webgpu.sh)"
        )
    _RECORDED.clear()
    ort_error = _outcome(_webgpu_tests("ort")[name])
    ran = ort_error is None or ort_error.startswith("AssertionError")
    _expect(request, None if ran else ort_error)
    _AgainstCpu.reference = list(_RECORDED)
    error = _outcome(_webgpu_tests("aioep")[name])
    _RESULTS["webgpu"][name] = (ran, error is None)
    if error is not None and ran:
        _AgainstCpu.reference = list(_RECORDED)
        plain_error = _outcome(_webgpu_tests("plain")[name])
        if plain_error is not None:
            request.applymarker(
                pytest.mark.xfail(
                    reason=f"the WebGPU EP fails without aioep too: {plain_error}", strict=False
                )
            )
    assert error is None, error


# -- the backend interface ----------------------------------------------------------------------
def _add_model() -> Any:
    h = onnx.helper
    vi = [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [3]) for n in ("x", "y", "z")]
    graph = h.make_graph([h.make_node("Add", ["x", "y"], ["z"])], "g", vi[:2], vi[2:])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_backend_interface() -> None:
    pytest.importorskip("aioep_sim")
    backend = aioep.onnx_backend
    assert backend.supports_device("CPU")
    assert not backend.supports_device("CUDA")
    x, y = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
    rep = backend.prepare(_add_model())
    assert rep.session.assignment == ("SimExecutionProvider",)  # the sim device by default
    (z,) = rep.run([x, y])
    np.testing.assert_array_equal(z, x + y)
    assert rep.run({"x": x, "y": y})["z"].tolist() == [1, 2, 3]
    with pytest.raises(aioep.InvalidArgument, match="1 input"):
        rep.run([x])
    rep.close()
    rep.close()
    with pytest.raises(aioep.ClosedError, match="closed"):
        rep.run([x, y])
    assert backend.run_model(_add_model(), [x, y])[0].tolist() == [1, 2, 3]
    node = onnx.helper.make_node("Mul", ["a", "b"], ["c"])
    (c,) = backend.run_node(node, [x, np.array(2, np.float32)])
    np.testing.assert_array_equal(c, x * 2)
    with pytest.raises(aioep.InvalidArgument, match="not supported"):
        backend.prepare(_add_model(), "CUDA")
    with pytest.raises(aioep.InvalidArgument, match="unknown keyword"):
        backend.prepare(_add_model(), bogus=1)
    # Dropped reps are closed at the next call.
    backend.prepare(_add_model())
    gc.collect()
    assert [s for owner, s in AioepBackend._closing if owner is AioepBackend]
    backend.prepare(_add_model()).close()
    assert not [s for owner, s in AioepBackend._closing if owner is AioepBackend]


def test_configured_backends() -> None:
    cpu_only = AioepBackend.configure(ep_devices=None, environment_options={"autoload": False})
    try:
        rep = cpu_only.prepare(_add_model())
        assert rep.session.assignment == ("CPUExecutionProvider",)
        rep.close()
        nowhere = AioepBackend.configure(ep_devices=["NoSuchExecutionProvider"])
        with pytest.raises(aioep.InvalidArgument, match="no EP devices named"):
            nowhere.prepare(_add_model())
        nowhere.close()
        with pytest.raises(aioep.InvalidArgument, match="ep_devices"):
            AioepBackend.configure(ep_devices="sim")
    finally:
        cpu_only.close()


@pytest.mark.anyio
async def test_the_blocking_backend_refuses_to_run_on_an_event_loop() -> None:
    with pytest.raises(aioep.EpError, match="event loop"):
        aioep.onnx_backend.prepare(_add_model())
