"""check-gpu: verify aioep's CUDA backend on a GPU in one call, into one JSON summary.

A tool of the aioep checkout, not part of any package: it runs the checkout's CUDA tests
and benchmarks, so it lives beside them. ``python -m aioep check-gpu`` (the entry point
aioep-cuda adds) runs it from a checkout (``--checkout PATH``, default the current
directory); so does ``python -m check_gpu`` with ``tools/`` on ``PYTHONPATH``.

Modules: `check_gpu.cli` (the options), `check_gpu.check` (the steps, into the summary),
`check_gpu.runner` (the crash-isolating test runner) with its pytest plugin
(`check_gpu.pytest_plugin`) and console progress (`check_gpu.progress`),
`check_gpu.benchmarks` (a benchmark's death keeps its figures), `check_gpu.judge` (the
figures, their targets and verdicts), the probes run as children (`check_gpu.probe_driver`,
`check_gpu.probe_dlpack`) and `check_gpu.process` (children with a time limit). Nothing is
imported here: the test children import the plugin, and only the plugin.
"""
