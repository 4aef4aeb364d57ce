"""The machinery behind the public tools: the CLI, benchmarks, ONNX backend, pytest plugin.

``bench`` (the benchmark harness behind `aioep.bench` and ``python -m aioep bench``),
``onnx_backend`` (ONNX's backend test API, behind `aioep.onnx_backend`),
``pytest_entry`` (the inert ``pytest11`` entry point), ``pytest_env`` (opening the
environment a test asks for, the leak check) and ``asyncio_fixtures`` (``aioep_env`` under
pytest-asyncio).

Imports every layer below it; only the public faces import it.
"""
