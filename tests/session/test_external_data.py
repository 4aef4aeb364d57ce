"""load_initializers, the external data loaders and the external data security rules."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aioep
from aioep._copies.chunked_loader import ChunkedExternalDataLoader
from aioep._session.external_data import resolve_location
from aioep._session.initializers import ExternalDataLoader

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

pytestmark = pytest.mark.anyio


# -- helpers -------------------------------------------------------------------------------
def _arrays() -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(7)
    return {
        "w1": rng.standard_normal((64, 48)).astype(np.float32),
        "b1": np.arange(100, dtype=np.int64),
        "w2": rng.standard_normal((3, 5, 700)).astype(np.float16),
        "mask": rng.integers(0, 2, 4000).astype(bool),
        "tiny": np.array([1, 2, 3], dtype=np.int32),  # stays inline (below the threshold)
        "empty": np.zeros((0, 4), dtype=np.float32),  # inline and empty
    }


def save_model(
    directory: Path,
    arrays: dict[str, np.ndarray[Any, Any]],
    *,
    one_file: bool = True,
    location: str = "weights.bin",
    threshold: int = 64,
    name: str = "model.onnx",
) -> Path:
    """Save a graph whose initializers are ``arrays``, large ones as external data."""
    (directory / location).parent.mkdir(parents=True, exist_ok=True)
    inits = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
    graph = helper.make_graph([], "g", [], [], inits)
    model = helper.make_model(graph)
    path = directory / name
    onnx.save(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=one_file,
        location=location,
        size_threshold=threshold,
    )
    return path


def edit_external(path: Path, name: str, **entries: str | None) -> None:
    """Rewrite one initializer's external_data entries (None removes a key)."""
    model = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    current = {e.key: e.value for e in tensor.external_data}
    for key, value in entries.items():
        if value is None:
            current.pop(key, None)
        else:
            current[key] = value
    del tensor.external_data[:]
    for key, value in current.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    path.write_bytes(model.SerializeToString())


def external_info(path: Path, name: str) -> dict[str, str]:
    model = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    return {e.key: e.value for e in tensor.external_data}


def host_env() -> contextlib.AbstractAsyncContextManager[aioep.Environment]:
    return aioep.Environment(autoload=False)


@contextlib.asynccontextmanager
async def sim_env(
    factory: Any = "aioep_sim:SimFactory", **options: Any
) -> AsyncIterator[aioep.Environment]:
    """An environment with the host and the sim backend (``factory``) only."""
    pytest.importorskip("aioep_sim")
    async with aioep.Environment(autoload=False) as env:
        env.register_library("sim", factory, options or None)
        yield env


def sim_device(env: aioep.Environment) -> aioep.EpDevice:
    return env.ep_devices(ep_name="SimExecutionProvider")[0]


def host_device(env: aioep.Environment) -> aioep.EpDevice:
    return env.ep_devices(device_type=aioep.DeviceType.CPU)[0]


async def to_host(env: aioep.Environment, t: aioep.Tensor) -> np.ndarray[Any, Any]:
    if t.is_host_accessible:
        return t.numpy().copy()
    h = env.empty(t.shape, t.dtype)
    await env.copy_tensors([t], [h])
    return h.numpy().copy()


async def assert_loaded(
    env: aioep.Environment, out: dict[str, aioep.Tensor], arrays: dict[str, Any]
) -> None:
    assert list(out) == list(arrays)
    for name, expected in arrays.items():
        got = await to_host(env, out[name])
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), name
        assert got.tobytes() == expected.tobytes(), name
    out.clear()  # the tensors go back to their allocator before the environment closes


def device_live(env: aioep.Environment, dev: aioep.EpDevice) -> dict[str, int]:
    """Live buffers per memory type of ``dev`` (the shared allocators)."""
    out = {}
    for mt in aioep.MemoryType:
        info = dev.memory_info(mt)
        if info is not None:
            alloc = env.get_shared_allocator(info)
            assert alloc is not None
            out[mt.value] = alloc.live_buffers
    return out


def _no_loader_factory() -> Any:
    """A sim factory that offers no external data loader: the built-in one is used."""
    aioep_sim = pytest.importorskip("aioep_sim")

    class NoLoaderSim(aioep_sim.SimFactory):  # type: ignore[misc,name-defined]
        def create_external_data_loader(self) -> None:
            return None

    return NoLoaderSim


# -- loading -------------------------------------------------------------------------------
@pytest.mark.parametrize("one_file", [True, False])
async def test_load_to_host(tmp_path: Path, one_file: bool) -> None:
    arrays = _arrays()
    path = save_model(tmp_path, arrays, one_file=one_file)
    if one_file:
        offsets = {n: int(external_info(path, n).get("offset", "0")) for n in ("w1", "b1", "w2")}
        assert len(set(offsets.values())) == 3  # several tensors at different offsets
    else:
        assert len([p for p in os.listdir(tmp_path) if not p.endswith(".onnx")]) == 4
    async with host_env() as env:
        out = await env.load_initializers(path, host_device(env), progress=False)
        assert all(t.memory_info.device.device_type is aioep.DeviceType.CPU for t in out.values())
        await assert_loaded(env, out, arrays)


async def test_load_several_files_with_offsets_and_subdirectory(tmp_path: Path) -> None:
    arrays = _arrays()
    path = save_model(tmp_path, arrays, location="data/part.bin")
    # Move two tensors into a second file, at offsets that are not 0.
    second = tmp_path / "data" / "second.bin"
    blob = bytearray(b"\xab" * 13)
    for name in ("w1", "mask"):
        info = external_info(path, name)
        raw = (tmp_path / info["location"]).read_bytes()
        chunk = raw[int(info.get("offset", "0")) :][: int(info["length"])]
        edit_external(path, name, location="data/second.bin", offset=str(len(blob)))
        blob += chunk + b"\xcd" * 7
    second.write_bytes(bytes(blob))
    async with host_env() as env:
        out = await env.load_initializers(str(path), host_device(env), progress=False)
        await assert_loaded(env, out, arrays)


async def test_load_to_sim_uses_the_registered_loader(tmp_path: Path) -> None:
    arrays = _arrays()
    path = save_model(tmp_path, arrays, one_file=False)
    async with sim_env() as env:
        dev = sim_device(env)
        loader = env.external_data_loader(dev.memory_info(aioep.MemoryType.DEFAULT))  # type: ignore[arg-type]
        assert type(loader).__name__ == "SimExternalDataLoader"
        assert env.external_data_loader(host_device(env).memory_info()) is None  # type: ignore[arg-type]
        out = await env.load_initializers(path, dev, progress=False)
        assert loader.loads == 4  # type: ignore[union-attr]
        assert not any(t.is_host_accessible for t in out.values())
        await assert_loaded(env, out, arrays)
        del out


async def test_sim_loader_without_stream(tmp_path: Path) -> None:
    arrays = {"w": np.arange(50_000, dtype=np.float32)}
    path = save_model(tmp_path, arrays)
    info = external_info(path, "w")
    async with sim_env() as env:
        dev = sim_device(env)
        mem = dev.memory_info()
        assert mem is not None
        loader = env.external_data_loader(mem)
        assert loader is not None
        loader.chunk_bytes = 4096  # type: ignore[attr-defined]
        t = env.empty((50_000,), np.float32, mem)
        await loader.load_tensor(tmp_path / info["location"], 0, t.nbytes, t)
        assert (await to_host(env, t)).tobytes() == arrays["w"].tobytes()
        with pytest.raises(aioep.InvalidArgument):
            await loader.load_tensor(tmp_path / info["location"], 0, t.nbytes - 4, t)
        del t


async def test_builtin_loader_stages_through_pinned_memory(tmp_path: Path) -> None:
    arrays = _arrays()
    arrays["big"] = np.random.default_rng(1).standard_normal(300_000).astype(np.float32)
    path = save_model(tmp_path, arrays)
    async with sim_env(_no_loader_factory()) as env:
        dev = sim_device(env)
        pinned = env.get_shared_allocator(dev.memory_info(aioep.MemoryType.HOST_ACCESSIBLE))  # type: ignore[arg-type]
        assert pinned is not None
        assert env.external_data_loader(dev.memory_info()) is None  # type: ignore[arg-type]
        seen: list[tuple[int, int]] = []
        out = await env.load_initializers(
            path,
            dev,
            progress=False,
            chunk_bytes=64 * 1024,
            on_progress=lambda done, total: seen.append((done, total)),
        )
        await assert_loaded(env, out, arrays)
        assert pinned.stats()["NumAllocs"] == 2  # one ring of two staging buffers
        assert pinned.live_buffers == 0  # freed after the load
        total = sum(a.nbytes for a in arrays.values())
        assert seen[-1] == (total, total)
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        assert len(seen) > 300_000 * 4 // (64 * 1024)  # progress per chunk
        del out


async def test_builtin_loader_on_its_own(tmp_path: Path) -> None:
    data = np.random.default_rng(2).integers(0, 255, 100_003, dtype=np.uint8)
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"x" * 11 + data.tobytes())
    async with sim_env() as env:
        dev = sim_device(env)
        loader = ChunkedExternalDataLoader(env, chunk_bytes=10_000, staging_buffers=3)
        assert loader.can_load(dev.memory_info())  # type: ignore[arg-type]
        t = env.empty((100_003,), np.uint8, dev.memory_info())
        chunks: list[int] = []
        await loader.load_tensor(blob, 11, t.nbytes, t, on_progress=chunks.append)  # no stream
        assert (await to_host(env, t)).tobytes() == data.tobytes()
        assert sum(chunks) == t.nbytes
        assert len(chunks) == 11
        async with dev.create_sync_stream() as stream:
            u = env.empty((100_003,), np.uint8, dev.memory_info())
            await loader.load_tensor(str(blob), 11, u.nbytes, u, stream=stream)
            assert (await to_host(env, u)).tobytes() == data.tobytes()
        assert loader.staging_bytes == 30_000
        # A file that shrank after validation is an error, not garbage.
        with pytest.raises(aioep.EpError, match="truncated") as caught:
            await loader.load_tensor(blob, 12, t.nbytes, t)
        del caught
        h = env.empty((100_003,), np.uint8)  # host destination: read directly
        await loader.load_tensor(blob, 11, h.nbytes, h)
        assert h.numpy().tobytes() == data.tobytes()
        loader.close()
        assert loader.staging_bytes == 0
        del t, u, h
        gc.collect()  # the truncation error's traceback made a cycle through t
        with pytest.raises(aioep.InvalidArgument):
            ChunkedExternalDataLoader(env, chunk_bytes=0)


async def test_names_subset_keeps_order(tmp_path: Path) -> None:
    arrays = _arrays()
    path = save_model(tmp_path, arrays)
    async with host_env() as env:
        out = await env.load_initializers(path, host_device(env), ["w2", "tiny"], progress=False)
        assert list(out) == ["w2", "tiny"]
        await assert_loaded(env, out, {k: arrays[k] for k in ("w2", "tiny")})
        with pytest.raises(aioep.InvalidArgument, match="nope"):
            await env.load_initializers(path, host_device(env), ["w1", "nope"], progress=False)
        with pytest.raises(aioep.InvalidArgument):
            await env.load_initializers(path, host_device(env), "w1", progress=False)  # type: ignore[arg-type]


async def test_progress_bar_and_missing_tqdm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    arrays = _arrays()
    path = save_model(tmp_path, arrays)
    async with host_env() as env:
        await env.load_initializers(path, host_device(env), progress=True)
        assert "model.onnx" in capsys.readouterr().err
        monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
        out = await env.load_initializers(path, host_device(env), progress=True)
        await assert_loaded(env, out, arrays)
        assert capsys.readouterr().err == ""


async def test_bad_arguments(tmp_path: Path) -> None:
    path = save_model(tmp_path, _arrays())
    async with sim_env() as env:
        dev = sim_device(env)
        other = env.ep_devices(ep_name="SimExecutionProvider")[1]
        with pytest.raises(aioep.InvalidArgument, match="chunk_bytes"):
            await env.load_initializers(path, dev, chunk_bytes=0)
        with pytest.raises(aioep.InvalidArgument, match="ep_device"):
            await env.load_initializers(path, "sim")  # type: ignore[arg-type]
        async with other.create_sync_stream() as stream:
            with pytest.raises(aioep.InvalidArgument, match="belongs to"):
                await env.load_initializers(path, dev, stream=stream)
        with pytest.raises(aioep.NoSuchFile):
            await env.load_initializers(tmp_path / "missing.onnx", dev)
        (tmp_path / "junk.onnx").write_bytes(b"\xff\x00not a model")
        with pytest.raises(aioep.InvalidArgument, match="not a valid ONNX model"):
            await env.load_initializers(tmp_path / "junk.onnx", dev)


async def test_explicit_stream_is_used_and_left_open(tmp_path: Path) -> None:
    arrays = _arrays()
    path = save_model(tmp_path, arrays)
    async with sim_env(_no_loader_factory()) as env:
        dev = sim_device(env)
        async with dev.create_sync_stream() as stream:
            out = await env.load_initializers(
                path, dev, progress=False, stream=stream, chunk_bytes=4096
            )
            assert not stream.closed
            await assert_loaded(env, out, arrays)
        del out


async def test_loader_is_unregistered_with_its_library(tmp_path: Path) -> None:
    async with sim_env() as env:
        mem = sim_device(env).memory_info()
        assert mem is not None
        assert env.external_data_loader(mem) is not None
        env.unregister_library("sim")
        assert env.external_data_loader(mem) is None


# -- security ------------------------------------------------------------------------------
def test_resolve_location_follows_ort(tmp_path: Path) -> None:
    base = str(tmp_path)
    (tmp_path / "data.bin").write_bytes(b"")
    assert resolve_location(base, "data.bin", "t") == str(tmp_path.resolve() / "data.bin")
    assert resolve_location(base, "sub/data.bin", "t").endswith("sub/data.bin")
    assert resolve_location(base, "sub\\data.bin", "t")  # a file name with a backslash on POSIX
    assert resolve_location(str(tmp_path / "non_existent_dir"), "data.bin", "t")
    assert resolve_location(base, "sub/../data.bin", "t")  # stays inside: fine
    for bad in ("../data.bin", "sub/../../data.bin", "a/b/../../../x.bin"):
        with pytest.raises(aioep.InvalidArgument, match="escapes model directory"):
            resolve_location(base, bad, "t")
    for bad in ("/data.bin", "/etc/passwd", "C:\\data.bin", "\\\\server\\share\\x.bin"):
        with pytest.raises(aioep.InvalidArgument, match="Absolute paths not allowed"):
            resolve_location(base, bad, "t")
    # A sibling directory whose name starts with the base's name is still outside.
    sibling = tmp_path.parent / (tmp_path.name + "x")
    with pytest.raises(aioep.InvalidArgument, match="escapes"):
        resolve_location(base, f"../{sibling.name}/data.bin", "t")


async def _refused(
    path: Path,
    exc: type[BaseException],
    match: str,
    *,
    sim: bool = False,
) -> pytest.ExceptionInfo[BaseException]:
    """Loading ``path`` fails with ``exc`` and allocates and reads nothing."""
    async with sim_env() if sim else host_env() as env:
        dev = sim_device(env) if sim else host_device(env)
        info = dev.memory_info()
        assert info is not None
        alloc = env.get_shared_allocator(info)
        assert alloc is not None
        before = alloc.stats()["NumAllocs"]
        loader = env.external_data_loader(info)
        with pytest.raises(exc, match=match) as caught:
            await env.load_initializers(path, dev, progress=False)
        assert alloc.stats()["NumAllocs"] == before  # nothing allocated, so nothing written
        assert alloc.live_buffers == 0
        if loader is not None:
            assert loader.loads == 0  # type: ignore[attr-defined]
    return caught


@pytest.mark.parametrize("sim", [False, True])
async def test_absolute_location_is_refused(tmp_path: Path, sim: bool) -> None:
    path = save_model(tmp_path / "m", _arrays())
    edit_external(path, "w2", location=str(tmp_path / "m" / "weights.bin"))
    await _refused(path, aioep.InvalidArgument, "Absolute paths not allowed", sim=sim)


@pytest.mark.parametrize("sim", [False, True])
async def test_dotdot_escape_is_refused(tmp_path: Path, sim: bool) -> None:
    path = save_model(tmp_path / "m", _arrays())
    (tmp_path / "secret.bin").write_bytes(b"\x00" * 100_000)  # exists: the path rule refuses it
    edit_external(path, "w1", location="../secret.bin", offset="0")
    caught = await _refused(path, aioep.InvalidArgument, "escapes model directory", sim=sim)
    assert "w1" in str(caught.value)


async def test_symlink_inside_is_allowed_outside_refused(tmp_path: Path) -> None:
    arrays = _arrays()
    path = save_model(tmp_path / "m", arrays)
    try:
        os.symlink(tmp_path / "m" / "weights.bin", tmp_path / "m" / "link.bin")
    except (OSError, NotImplementedError):
        pytest.skip("cannot create symlinks here")
    for name in ("w1", "b1"):
        edit_external(path, name, location="link.bin")
    async with host_env() as env:
        out = await env.load_initializers(path, host_device(env), progress=False)
        await assert_loaded(env, out, arrays)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target.bin").write_bytes((tmp_path / "m" / "weights.bin").read_bytes())
    os.symlink(outside / "target.bin", tmp_path / "m" / "outside_link.bin")
    edit_external(path, "b1", location="outside_link.bin")
    await _refused(path, aioep.InvalidArgument, "escapes model directory")
    # A symlinked directory pointing outside is refused the same way.
    os.symlink(outside, tmp_path / "m" / "dirlink")
    edit_external(path, "b1", location="dirlink/target.bin")
    await _refused(path, aioep.InvalidArgument, "escapes model directory")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("offset", "-1", "must be >= 0"),
        ("offset", "abc", "Failed to parse value"),
        ("offset", "1.5", "Failed to parse value"),
        ("offset", str(2**65), "Failed to parse value"),
        ("length", str(2**65), "Failed to parse value"),
        # over the 4,300 digits int() parses: refused as any number out of range, unprinted
        ("offset", "9" * 5000, r"Failed to parse value '9{20}\.\.\.\(5000 characters\)'"),
        ("length", "-8", "must be >= 0"),
        ("length", "12", "size mismatch"),
        ("offset", "999999999", "beyond the end"),
    ],
)
async def test_bad_offset_or_length_is_refused(
    tmp_path: Path, key: str, value: str, match: str
) -> None:
    path = save_model(tmp_path, _arrays())
    edit_external(path, "w2", **{key: value})
    await _refused(path, aioep.InvalidArgument, match)


async def test_range_past_end_of_file_is_refused(tmp_path: Path) -> None:
    path = save_model(tmp_path, _arrays(), one_file=False)
    edit_external(path, "w1", offset="4")  # length stays the tensor's size: runs past the end
    await _refused(path, aioep.InvalidArgument, "beyond the end")


async def test_length_absent_means_to_the_end(tmp_path: Path) -> None:
    arrays = _arrays()
    path = save_model(tmp_path, arrays, one_file=False)
    edit_external(path, "w1", length=None)  # the file holds exactly the tensor: fine
    async with host_env() as env:
        out = await env.load_initializers(path, host_device(env), progress=False)
        await assert_loaded(env, out, arrays)
    path = save_model(tmp_path / "one", arrays, one_file=True)
    edit_external(path, "w1", length=None)  # more data follows it in the shared file
    await _refused(path, aioep.InvalidArgument, "size mismatch")


@pytest.mark.parametrize("sim", [False, True])
async def test_missing_file_is_no_such_file(tmp_path: Path, sim: bool) -> None:
    path = save_model(tmp_path, _arrays(), one_file=False)
    (tmp_path / "w2").unlink()
    caught = await _refused(path, aioep.NoSuchFile, "w2", sim=sim)
    err = caught.value
    assert isinstance(err, aioep.EpError)
    assert err.code is aioep.ErrorCode.NO_SUCHFILE
    assert str(tmp_path / "w2") in str(err)
    assert "initializer 'w2'" in str(err)


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ({"basepath": "x"}, "unknown external data key 'basepath'"),
        ({"checksum": ""}, "Need a key and a value"),
        ({"location": None}, "Missing 'location'"),
        ({"location": "*/_ORT_MEM_ADDR_/*"}, "in-memory references"),
    ],
)
async def test_bad_external_data_info_is_refused(
    tmp_path: Path, entries: dict[str, str | None], match: str
) -> None:
    path = save_model(tmp_path, _arrays())
    edit_external(path, "w1", **entries)
    await _refused(path, aioep.InvalidArgument, match)


async def test_checksum_key_is_accepted(tmp_path: Path) -> None:
    arrays = _arrays()
    path = save_model(tmp_path, arrays)
    edit_external(path, "w1", checksum="abc123")
    async with host_env() as env:
        await assert_loaded(
            env, await env.load_initializers(path, host_device(env), progress=False), arrays
        )


async def test_directory_location_is_refused(tmp_path: Path) -> None:
    path = save_model(tmp_path, _arrays())
    (tmp_path / "adir").mkdir()
    edit_external(path, "w1", location="adir")
    await _refused(path, aioep.InvalidArgument, "not a regular file")


async def test_string_tensors_are_refused(tmp_path: Path) -> None:
    path = save_model(tmp_path, _arrays())
    model = onnx.load(str(path), load_external_data=False)
    model.graph.initializer.append(
        helper.make_tensor("words", TensorProto.STRING, [2], [b"a", b"b"])
    )
    path.write_bytes(model.SerializeToString())
    await _refused(path, aioep.InvalidArgument, "string tensor")


async def test_last_initializer_bad_means_nothing_loaded(tmp_path: Path) -> None:
    # Validation covers every initializer before the first is allocated or read.
    path = save_model(tmp_path, _arrays())
    edit_external(path, "mask", location="../../etc/passwd")
    await _refused(path, aioep.InvalidArgument, "mask", sim=True)


# -- failures and cancellation -------------------------------------------------------------
class _Gate(ExternalDataLoader):
    """Wraps a loader; fails or blocks on the n-th tensor; remembers tensors by weakref."""

    def __init__(self, inner: ExternalDataLoader, at: int, action: str) -> None:
        self.inner, self.at, self.action = inner, at, action
        self.calls = 0
        self.seen: list[weakref.ref[aioep.Tensor]] = []
        self.buffers: list[aioep.Buffer] = []
        self.blocked = anyio.Event()

    def can_load(self, memory_info: aioep.MemoryInfo) -> bool:
        return self.inner.can_load(memory_info)

    async def load_tensor(
        self, path: Any, offset: int, length: int, tensor: aioep.Tensor, *, stream: Any = None
    ) -> None:
        self.calls += 1
        self.seen.append(weakref.ref(tensor))
        self.buffers.append(tensor.buffer)
        if self.calls == self.at:
            if self.action == "fail":
                raise OSError("disk on fire")
            self.blocked.set()
            await anyio.sleep_forever()
        await self.inner.load_tensor(path, offset, length, tensor, stream=stream)


async def _check_all_freed(
    env: aioep.Environment,
    dev: aioep.EpDevice,
    before: dict[str, int],
    gate: _Gate | None,
    *,
    collected: bool = True,
) -> None:
    gc.collect()
    assert device_live(env, dev) == before
    if gate is not None:
        assert all(b.freed for b in gate.buffers)
    if gate is not None and collected:  # (an exception's traceback keeps its frames' tensors)
        assert gate.seen
        assert all(ref() is None for ref in gate.seen)


@pytest.mark.parametrize("sim", [False, True])
async def test_failure_midway_frees_everything(tmp_path: Path, sim: bool) -> None:
    path = save_model(tmp_path, _arrays())
    async with sim_env() if sim else host_env() as env:
        dev = sim_device(env) if sim else host_device(env)
        info = dev.memory_info()
        assert info is not None
        inner = env.external_data_loader(info) or ChunkedExternalDataLoader(env)
        gate = _Gate(inner, 3, "fail")
        before = device_live(env, dev)
        with pytest.raises(aioep.DeviceError, match="disk on fire") as caught:
            await env.load_initializers(path, dev, progress=False, loader=gate)
        assert "initializer 'w2'" in str(caught.value)
        assert isinstance(caught.value.__cause__, OSError)
        await _check_all_freed(env, dev, before, gate, collected=False)
        if isinstance(inner, ChunkedExternalDataLoader):
            inner.close()


async def test_device_failure_in_builtin_loader_frees_everything(tmp_path: Path) -> None:
    arrays = _arrays()
    arrays["big"] = np.ones(200_000, np.float32)
    path = save_model(tmp_path, arrays)
    async with sim_env(_no_loader_factory(), fail_after_copies=5) as env:
        dev = sim_device(env)
        before = device_live(env, dev)
        with pytest.raises(aioep.DeviceError, match="injected failure"):
            await env.load_initializers(path, dev, progress=False, chunk_bytes=8192)
        await _check_all_freed(env, dev, before, None)
        assert env._open_streams() == []  # the stream it made for itself is closed


@pytest.mark.parametrize("sim", [False, True])
async def test_cancellation_midway_frees_everything(tmp_path: Path, sim: bool) -> None:
    path = save_model(tmp_path, _arrays())
    async with sim_env() if sim else host_env() as env:
        dev = sim_device(env) if sim else host_device(env)
        info = dev.memory_info()
        assert info is not None
        inner = env.external_data_loader(info) or ChunkedExternalDataLoader(env)
        gate = _Gate(inner, 3, "block")
        before = device_live(env, dev)
        result: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def load() -> None:
                result.append(await env.load_initializers(path, dev, progress=False, loader=gate))

            tg.start_soon(load)
            await gate.blocked.wait()
            tg.cancel_scope.cancel()
        assert result == []
        await _check_all_freed(env, dev, before, gate)
        if isinstance(inner, ChunkedExternalDataLoader):
            inner.close()


async def test_cancellation_inside_builtin_loader_frees_everything(tmp_path: Path) -> None:
    arrays = {"a": np.ones(100_000, np.float32), "b": np.arange(300_000, dtype=np.float32)}
    path = save_model(tmp_path, arrays)
    async with sim_env(_no_loader_factory(), latency_us=200) as env:
        dev = sim_device(env)
        before = device_live(env, dev)
        in_use = dev.memory_info()
        sim_mem = env.get_shared_allocator(in_use)  # type: ignore[arg-type]
        assert sim_mem is not None
        total = sum(a.nbytes for a in arrays.values())
        with anyio.CancelScope() as scope:

            def cancel_halfway(done: int, _: int) -> None:
                if done > total // 2:
                    scope.cancel()

            await env.load_initializers(
                path, dev, progress=False, chunk_bytes=16384, on_progress=cancel_halfway
            )
        assert scope.cancelled_caught
        await _check_all_freed(env, dev, before, None)
        assert sim_mem.stats()["InUse"] == 0
        assert env._open_streams() == []


# -- sessions: the same rules, before anything runs, whichever EP reads the data ---------------
def _add_w_model(folder: Path, location: str = "w.bin") -> tuple[Path, np.ndarray[Any, Any]]:
    """y = x + w with w (float32[4]) kept in ``folder``/w.bin and named by ``location``; the
    model is saved as ``folder``/m.onnx. Returns its path and w."""
    folder.mkdir(parents=True, exist_ok=True)
    w = np.arange(4, dtype=np.float32) + 0.5
    w.tofile(folder / "w.bin")
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [tensor])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "m.onnx"
    onnx.save(model, path)
    return path, w


async def _session_result(env: aioep.Environment, model: Any, sim: bool, **options: Any) -> Any:
    devices = [sim_device(env)] if sim else []
    async with await env.create_session(model, devices, options or None) as sess:
        assert (sess.assignment == ("SimExecutionProvider",)) is sim
        (y,) = await sess.run(None, {"x": np.ones(4, np.float32)})
        return y


@pytest.mark.parametrize("sim", [False, True])
@pytest.mark.parametrize("where", ["dotdot", "absolute", "link"])
async def test_a_session_refuses_external_data_outside_the_model_folder(
    tmp_path: Path, sim: bool, where: str
) -> None:
    outside = tmp_path / "outside"
    _add_w_model(outside)
    location = {
        "dotdot": "../outside/w.bin",
        "absolute": str(outside / "w.bin"),
        "link": "link.bin",
    }[where]
    path, _ = _add_w_model(tmp_path / "m", location)
    (tmp_path / "m" / "link.bin").symlink_to(outside / "w.bin")
    # Before: onnx's checker raised its own ValidationError on the sim, onnxruntime an EpError
    # on the CPU.
    async with sim_env() as env:
        with pytest.raises(aioep.InvalidArgument, match="initializer: w") as caught:
            await env.create_session(path, [sim_device(env)] if sim else [])
    assert location in str(caught.value)


@pytest.mark.parametrize("sim", [False, True])
async def test_a_session_reads_external_data_through_a_link_inside_its_folder(
    tmp_path: Path, sim: bool
) -> None:
    path, w = _add_w_model(tmp_path / "m", "link.bin")
    (tmp_path / "m" / "link.bin").symlink_to(tmp_path / "m" / "w.bin")
    async with sim_env() as env:
        np.testing.assert_array_equal(await _session_result(env, path, sim), w + 1)


@pytest.mark.parametrize("sim", [False, True])
async def test_a_session_checks_every_external_reference_before_it_runs(
    tmp_path: Path, sim: bool
) -> None:
    path, _ = _add_w_model(tmp_path)
    async with sim_env() as env:
        devices = [sim_device(env)] if sim else []
        edit_external(path, "w", length="12")
        with pytest.raises(aioep.InvalidArgument, match="size mismatch: length 12"):
            await env.create_session(path, devices)
        edit_external(path, "w", length=None, offset="8")
        with pytest.raises(aioep.InvalidArgument, match="holds 8 bytes from offset 8"):
            await env.create_session(path, devices)
        edit_external(path, "w", offset=None, location="gone.bin")
        with pytest.raises(aioep.NoSuchFile, match=r"'gone\.bin'"):
            await env.create_session(path, devices)


@pytest.mark.parametrize("sim", [False, True])
async def test_a_model_as_bytes_or_proto_finds_external_data_in_the_folder_given(
    tmp_path: Path, sim: bool
) -> None:
    path, w = _add_w_model(tmp_path / "m")
    proto = onnx.load(str(path), load_external_data=False)
    async with sim_env() as env:
        devices = [sim_device(env)] if sim else []
        for model in (proto, proto.SerializeToString()):
            with pytest.raises(aioep.InvalidArgument, match="external_data_dir") as caught:
                await env.create_session(model, devices)
            assert "'w.bin'" in str(caught.value)
            for folder in (tmp_path / "m", str(tmp_path / "m")):
                got = await _session_result(env, model, sim, external_data_dir=folder)
                np.testing.assert_array_equal(got, w + 1)
        # The folder's own rules hold: a location that leaves it is refused.
        edit_external(path, "w", location="../m/../w.bin")
        escaping = onnx.load(str(path), load_external_data=False)
        with pytest.raises(aioep.InvalidArgument, match="escapes model directory"):
            await env.create_session(escaping, devices, {"external_data_dir": tmp_path / "m"})
        with pytest.raises(aioep.InvalidArgument, match="external_data_dir is for a model given"):
            await env.create_session(path, devices, {"external_data_dir": tmp_path})
        with pytest.raises(aioep.NoSuchFile, match="is not a folder"):
            await env.create_session(proto, devices, {"external_data_dir": tmp_path / "no"})
        with pytest.raises(aioep.InvalidArgument, match="must be a folder path, got int 3"):
            await env.create_session(proto, devices, {"external_data_dir": 3})


def test_check_external_data_sizes_packed_types(tmp_path: Path) -> None:
    from aioep._session.external_data import check_external_data

    (tmp_path / "d.bin").write_bytes(b"\x12" * 3)
    tensor = TensorProto(name="q", data_type=TensorProto.INT4, dims=[5])  # 5 nibbles: 3 bytes
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="d.bin")
    (found,) = check_external_data([tensor], str(tmp_path))
    assert (found.offset, found.length) == (0, 3)
    tensor.dims[:] = [7]  # 4 bytes: more than the file holds
    with pytest.raises(aioep.InvalidArgument, match="size mismatch"):
        check_external_data([tensor], str(tmp_path))
    inline = TensorProto(name="i", data_type=TensorProto.FLOAT, dims=[1], float_data=[1.0])
    assert check_external_data([inline], str(tmp_path)) == []
