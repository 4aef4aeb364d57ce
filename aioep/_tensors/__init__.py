"""Tensors and buffers, and who owns a buffer's memory.

``tensor`` (`Tensor`, `Buffer`, host memory info, DLPack export),
``exports`` (what a DLPack export holds, and the memory handed out to other libraries) and
``ownership`` (each allocator's origin, the check that keeps an environment to its own
memory).

Imports only ``_base`` at run time.
"""
