"""Where memory comes from: the arena, and other libraries' arrays.

``arena`` (`ArenaAllocator`, ORT's BFC arena with stream-aware reuse) over
``arena_buffer`` (its buffers, released without its lock), ``arena_sizes`` (size classes),
``arena_pool`` (the stream-aware pools and their growth), ``arena_parking`` (parked and
cached chunks, the stream rule), ``arena_regions``, ``arena_config`` and ``bfc`` (the
best-fit coalescing core: no streams, no locks); ``dlpack`` (the DLPack structures:
reading capsules, making them) and ``foreign`` (DLPack and CUDA Array Interface objects
wrapped zero-copy, with the ownership rule).

Imports ``_base``, ``_graph`` and ``_plugin``.
"""
