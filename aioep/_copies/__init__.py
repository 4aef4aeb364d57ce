"""Copying in one place: ``copy_tensors`` end to end, and the futures it returns.

``dispatcher`` (validate, plan and route a batch of copies; run them inline, on a stream or
on the copy workers), ``future`` (`CopyFuture`, awaitable from asyncio and trio),
``workers`` (the threads that run copies without a stream) and ``chunked_loader``
(`ChunkedExternalDataLoader`: external data read in chunks and copied to the device).

Imports ``_base``, ``_graph``, ``_plugin`` and ``_memory``.
"""
