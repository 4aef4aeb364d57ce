"""Streams and notifications, and how a waiting task is woken.

``stream`` (`SyncStream`), ``notification`` (`Notification`),
``stream_impl`` (what a backend implements: ORT's ``OrtSyncStreamImpl`` and
``OrtSyncNotificationImpl``, and `ThreadStream`), ``wake`` (the one
event-loop-specific piece: wake a task from any thread) and ``routes`` (which data transfer
copies between two memory devices, cached per stream).

Imports only ``_base`` at run time.
"""
