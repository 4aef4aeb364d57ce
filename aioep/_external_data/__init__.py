"""External data: initializers stored outside the model file, read onto devices.

``info`` (the model's external-data entries, checked as ORT checks them), ``loader`` (the
`ExternalDataLoader` interface a factory may offer), ``chunked_loader``
(the built-in loader: chunked reads off the event loop) and ``loading`` (which loader
reads each initializer).

Imports the layers below, up to ``_devices``.
"""
