"""Memory: allocators, arenas and the data transfers that move bytes between devices.

``allocator`` (`Allocator`), ``transfer``
(`DataTransfer` and the copy plan), ``arena`` (`ArenaAllocator`,
ORT's BFC arena with stream-aware reuse) over ``arena_pool``, ``arena_regions``,
``arena_config`` and ``bfc`` (the best-fit coalescing core: no streams, no locks).

Imports ``_base``, ``_tensors`` and ``_streams``.
"""
