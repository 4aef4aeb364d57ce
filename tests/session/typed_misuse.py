"""Calls ``mypy --strict`` must refuse (tests/session/test_typing.py): each line marked
``# refused`` must have an error."""

from __future__ import annotations

import numpy as np

import aioep


async def main(session: aioep.Session) -> None:
    feeds = {"x": np.ones(4, np.float32)}
    await session.run("y", feeds)  # refused
    await session.run(None, feeds, output_location="host")  # refused
    await session.run(feeds, run_options=None)  # refused
    await session.run(feeds, output_location="gpu")  # refused
    aioep.copy_tensors([object()], [np.empty(4)])  # refused
