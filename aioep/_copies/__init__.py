"""Copies: ``copy_tensors`` end to end, and the futures it returns.

``dispatcher`` (validate, plan and route a batch of copies; run them inline, on a stream or
on the copy executor) and ``future`` (`CopyFuture`, awaitable from asyncio and
trio).

Imports the layers below, up to ``_devices``.
"""
