"""The ground floor: errors, value types, options and argument checks.

``errors`` (the `EpError` tree), ``types`` (device kinds, hardware and memory
devices, memory infos), ``options`` (option parsing), ``validate`` (the argument checks of
the public boundary) and ``progress`` (tqdm bars for long set-up work).

Imports nothing of aioep outside this package.
"""
