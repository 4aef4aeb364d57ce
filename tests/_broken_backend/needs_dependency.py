import aioep_missing_dependency  # noqa: F401

Factory = None
