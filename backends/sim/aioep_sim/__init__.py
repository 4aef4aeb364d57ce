"""aioep-sim: a simulated accelerator, the reference aioep backend.

Entry point ``sim`` in group ``aioep.backends`` names [`SimFactory`][aioep_sim.SimFactory].
Copy this package to start a new backend; the README says how.
"""

from aioep.abc import register_dlpack_exporter

from ._device import SIM_VENDOR_ID as SIM_VENDOR_ID
from ._device import EngineUse as EngineUse
from ._device import SimDevice as SimDevice
from ._dlpack import SimMemoryImporter as SimMemoryImporter
from ._dlpack import export_dlpack as export_dlpack
from ._factory import SimFactory as SimFactory
from ._options import SimOptions as SimOptions
from ._stream import SimStream as SimStream

__all__ = [
    "SIM_VENDOR_ID",
    "EngineUse",
    "SimDevice",
    "SimFactory",
    "SimMemoryImporter",
    "SimOptions",
    "SimStream",
    "export_dlpack",
]

register_dlpack_exporter(SIM_VENDOR_ID, export_dlpack)
