"""What an environment found still alive when it closed: a diagnostic a user asks for.

Leaving an environment with a stream or session still open, or with a tensor still named
by a local, is ordinary code: the environment closes the streams and sessions for you, and
a buffer stays valid until it is dropped. So none of it is a warning. It is recorded in
`Environment.close_report` instead, which the pytest plugin's leak check reads.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CloseReport", "LiveBuffers"]


@dataclass(frozen=True)
class LiveBuffers:
    """The buffers of one allocator that were still alive when the environment closed."""

    library: str
    """The library (registration name) the allocator belongs to."""
    memory: str
    """The name of the allocator's memory info (``"Cpu"``, ``"Sim"``, ``"Cuda"``)."""
    count: int
    """How many buffers were alive."""
    nbytes: int
    """The bytes they held."""
    allocator: str
    """The allocator's repr."""

    def __str__(self) -> str:
        return (
            f"{self.allocator} of library {self.library!r} still had {self.count} live "
            f"buffer(s) ({self.nbytes} bytes) when the environment closed; they stay valid "
            "until dropped"
        )


@dataclass(frozen=True)
class CloseReport:
    """What an environment found still alive when it closed (``env.close_report``).

    Nothing here is an error: the environment closed the streams and sessions itself,
    and live buffers stay valid until dropped (their allocator, and then their factory,
    close after the last one). A test suite can fail a test that leaves any of it behind,
    as the pytest plugin's leak check does. The report holds descriptions, never the
    objects themselves, so it keeps nothing alive.
    """

    streams: tuple[str, ...] = ()
    """Each stream that was still open (the environment closed it), as its repr."""
    sessions: tuple[str, ...] = ()
    """Each session that was still open (the environment closed it), as its repr."""
    buffers: tuple[LiveBuffers, ...] = ()
    """Per allocator, the buffers still alive (not counting those only reference cycles held)."""

    @property
    def clean(self) -> bool:
        """True when nothing was left: no open stream or session, no live buffer."""
        return not (self.streams or self.sessions or self.buffers)

    @property
    def live_buffers(self) -> int:
        """How many buffers were still alive, over every allocator."""
        return sum(b.count for b in self.buffers)

    def lines(self) -> list[str]:
        """One sentence per finding (empty when `clean`)."""
        found = [f"{s} was still open when the environment closed" for s in self.streams]
        found += [f"{s} was still open when the environment closed" for s in self.sessions]
        found += [str(b) for b in self.buffers]
        return found

    def __str__(self) -> str:
        return "\n".join(self.lines()) or "nothing was left alive"
