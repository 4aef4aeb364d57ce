"""The environment: the facade that ties the layers together.

``environment`` (`Environment`, ``async with`` and blocking; `copy_tensors`), ``settings``
(its constructor's arguments, checked), ``services`` (what it hands to its sessions: the
``_session.host.SessionHost`` they declare), ``registry`` (loading libraries from entry
points or paths, in-use checks, teardown order), ``library`` (the record of one registered
library), ``streams`` (the libraries' streams: made, lent from their pools, closed),
``shared_allocators`` (one per memory device, with ORT's rules), ``stream_pool`` (the
streams ``env.pooled_stream`` lends, shared round-robin), ``report`` (what an environment
found still alive when it closed: `CloseReport`) and ``host`` (the host library every
environment registers: host memory, its allocator and memcpy transfer).

Imports every layer below it, sessions included (``create_session``); nothing below imports
it: the layers below declare what they need of it as protocols (``SessionHost``,
``CopyLibraries``, ``LoaderHost``, ``StreamMaker``, ``EpEnvironment``).
"""
