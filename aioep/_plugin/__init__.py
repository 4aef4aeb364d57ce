"""The plugin contract, and the objects that cross it.

What a backend implements, as ORT's plugin EP API names it: ``factory`` (`EpFactory`,
``OrtEpFactory``), ``allocator`` (`Allocator`, ``OrtAllocator``) and ``buffer`` (`Buffer`,
the memory it hands out, and `ImportedBuffer`: they name each other, as cuda.core keeps
``Buffer`` beside its memory resource),
``transfer`` (`DataTransfer`, ``OrtDataTransferImpl``), ``stream_impl`` (`StreamImpl` and
`NotificationImpl`, ``OrtSyncStreamImpl`` and ``OrtSyncNotificationImpl``),
``thread_stream`` (`ThreadStream`, a stream on a worker thread, and its notification), ``ep`` (`Ep`, ``OrtEp``), ``loader``
(`ExternalDataLoader`) and ``importer`` (`MemoryImporter`). The objects those pass:
``device`` (`EpDevice`), ``stream`` (`SyncStream`), ``notification`` (`Notification`),
``tensor`` (`Tensor`), ``copy_check`` (which copy batches the copy fast path takes as
they are), ``exports`` (DLPack exports that hold a buffer), ``ownership``
(which environment and library made a tensor), ``routes`` (which transfer copies between
two memory devices, cached per stream) and ``wake`` (waking a task's event loop from any
thread). `aioep.abc` re-exports the contract from here.

Imports ``_base`` and ``_graph``. The contract's types name each other in a ring (a stream
its device, a device its factory, a factory what it makes), so its modules may import each
other (pyproject.toml's no-cycles contract skips this package); nothing here imports a layer
above.
"""
