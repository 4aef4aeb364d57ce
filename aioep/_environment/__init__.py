"""The environment: plugin libraries, their devices, shared allocators and copies.

``environment`` (`Environment`, ``async with`` and blocking), ``registry``
(loading libraries from entry points or paths, in-use checks, teardown order) and
``shared_allocators`` (one per memory device, with ORT's rules), ``stream_pool`` (the
streams ``env.pooled_stream`` lends, shared round-robin) and ``report`` (what an
environment found still alive when it closed: `CloseReport`).

Imports every layer below it; nothing below imports it at run time.
"""
