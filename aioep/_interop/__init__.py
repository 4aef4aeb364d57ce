"""Foreign tensors: other libraries' arrays taken zero-copy.

``dlpack`` (the DLPack structures and capsule reader), ``importer`` (the
`MemoryImporter` plugin hook; the host's importer) and ``foreign`` (taking a
DLPack or CUDA Array Interface object wherever aioep takes a tensor, in stream order).

Imports ``_base``, ``_tensors`` and ``_streams``.
"""
