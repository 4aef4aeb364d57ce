"""The environment: the facade that ties the layers together.

``environment`` (`Environment`, ``async with`` and blocking; `copy_tensors`), ``registry``
(loading libraries from entry points or paths, in-use checks, teardown order),
``shared_allocators`` (one per memory device, with ORT's rules), ``stream_pool`` (the
streams ``env.pooled_stream`` lends, shared round-robin), ``report`` (what an environment
found still alive when it closed: `CloseReport`) and ``host`` (the host library every
environment registers: host memory, its allocator and memcpy transfer).

Imports every layer below it, sessions included (``create_session``); nothing below imports
it.
"""
