"""``python -m aioep devices``: the table and the JSON form."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import types
from typing import Any

import pytest
from _factories import BrokenFactory, FakeGpuFactory

from aioep import __main__ as cli
from aioep._environment import registry as _registry


@pytest.fixture
def fake_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("aioep_cli_backends")
    module.FakeGpuFactory = FakeGpuFactory  # type: ignore[attr-defined]
    module.BrokenFactory = BrokenFactory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "aioep_cli_backends", module)
    eps = [
        importlib.metadata.EntryPoint(
            "fake", "aioep_cli_backends:FakeGpuFactory", "aioep.backends"
        ),
        importlib.metadata.EntryPoint(
            "broken", "aioep_cli_backends:BrokenFactory", "aioep.backends"
        ),
    ]
    monkeypatch.setattr(_registry, "_backend_entry_points", lambda: iter(eps))


def test_devices_table(fake_backends: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    sections = ["EP devices", "Memory infos", "Shared allocators", "Load errors"]
    assert [line for line in out.splitlines() if line in sections] == sections
    assert "host" in out
    assert "FakeGpuExecutionProvider" in out
    assert "0xbe57" in out  # the fake device's vendor id
    assert "FakeGpu" in out
    assert "gpu:0xbe57:0" in out
    assert "RecordingAllocator" in out
    assert "HostAllocator" in out
    assert "broken: RuntimeError: libbroken.so.1" in out


def test_devices_json(fake_backends: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["libraries"] == ["host", "fake"]
    names = [d["ep_name"] for d in data["ep_devices"]]
    assert names == ["host", "FakeGpuExecutionProvider"]
    fake = data["ep_devices"][1]
    assert fake["type"] == "GPU"
    assert fake["vendor_id"] == 0xBE57
    assert fake["device_id"] == 0
    assert fake["ep_metadata"]["version"] == "0.1.0"
    assert fake["memory_infos"][0]["name"] == "FakeGpu"
    assert fake["memory_infos"][0]["memory_type"] == "DEFAULT"
    shared = {a["memory_device"]: a for a in data["shared_allocators"]}
    assert shared["gpu:0xbe57:0"]["allocator"] == "RecordingAllocator"
    assert shared["cpu:0x0:0"]["allocator"] == "HostAllocator"
    assert set(data["load_errors"]) == {"broken"}


def test_devices_no_autoload_and_backend_filter(
    fake_backends: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["devices", "--json", "--no-autoload"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["libraries"] == ["host"]
    assert data["load_errors"] == {}
    assert cli.main(["devices", "--json", "--backend", "fake"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["libraries"] == ["host", "fake"]
    assert data["load_errors"] == {}


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "devices" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["nonsense"])


def test_unknown_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["devices", "--no-autoload", "--bogus", "x"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus x" in capsys.readouterr().err


def test_a_passthrough_command_gets_the_arguments_it_did_not_declare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plugin command (check-gpu) that sets ``passthrough=True`` hands its other arguments
    to a parser it loads later: they arrive in order, ``--`` and what follows included."""
    seen: list[Any] = []

    def add(sub: Any) -> None:
        p = sub.add_parser("relay", add_help=False, allow_abbrev=False)
        p.add_argument("--where", default=".")
        p.set_defaults(
            func=lambda args: seen.append((args.where, args.rest)) or 0, passthrough=True
        )

    monkeypatch.setattr(cli, "_add_plugin_commands", add)
    argv = ["relay", "--budget", "270", "--where", "/x", "--help", "--", "-k", "a and b"]
    assert cli.main(argv) == 0
    assert seen == [("/x", ["--budget", "270", "--help", "--", "-k", "a and b"])]


def test_python_dash_m_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aioep", "devices", "--json", "--no-autoload"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ep_devices"][0]["ep_name"] == "host"
    assert data["ep_devices"][0]["type"] == "CPU"
