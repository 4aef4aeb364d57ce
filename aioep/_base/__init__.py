"""The ground floor: errors, value types, options and argument checks.

``errors`` (the `EpError` tree), ``types`` (device kinds, hardware and memory
devices, memory infos), ``options`` (option parsing), ``validate`` (the argument checks of
the public boundary), ``progress`` (tqdm bars for long set-up work), ``protocols`` (the
structural types of other libraries' tensors) and ``paths`` (where external data may live).

Imports nothing of aioep outside this package.
"""
