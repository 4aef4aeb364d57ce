"""The environment: plugin libraries, their devices, shared allocators and copies.

``environment`` (:class:`~aioep.Environment`, ``async with`` and blocking), ``registry``
(loading libraries from entry points or paths, in-use checks, teardown order) and
``shared_allocators`` (one per memory device, with ORT's rules) and ``report`` (what an
environment found still alive when it closed: :class:`~aioep.CloseReport`).

Imports every layer below it; nothing below imports it at run time.
"""
