"""Factories and devices: what a plugin offers, and the host device built into the core.

``factory`` (`EpFactory`, ORT's ``OrtEpFactory``), ``device``
(`EpDevice`, ORT's ``OrtEpDevice``) and ``host`` (the host CPU's factory: an
aligned allocator, a parallel memcpy data transfer, an in-order worker-thread stream).

Imports the layers below: ``_base``, ``_tensors``, ``_streams``, ``_memory``, ``_interop``.
"""
