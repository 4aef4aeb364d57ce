"""Error lanes on a shared ``ThreadStream``: the failure of a borrower's work is reported by
that borrower's next mark only (``stream_impl.ErrorLane``), whatever the interleaving."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioep._plugin.thread_stream import enter_lane, leave_lane
from aioep.abc import HostNotification, ThreadStream

LANES = (None, 0, 1, 2)  # None: work enqueued outside any lane


@dataclass(frozen=True)
class Step:
    lane: int | None
    action: str  # "ok", "fail", "mark" or "remark" (re-activate the lane's last mark)


steps = st.lists(
    st.builds(
        Step,
        st.sampled_from(LANES),
        st.sampled_from(["ok", "fail", "fail", "mark", "mark", "remark"]),
    ),
    max_size=40,
)


class Failure(Exception):
    pass


def fail(tag: str) -> None:
    raise Failure(tag)


def expected(program: list[Step], gated: bool) -> dict[int, str | None]:
    """Mark index -> the tag it reports: the first failure of its lane since that lane's
    previous mark. A re-activated mark was never reached (the worker is gated): it moves to
    the new point, and the failure it would have reported stays with the lane."""
    pending: dict[int | None, str | None] = dict.fromkeys(LANES)
    last: dict[int | None, int] = {}
    result: dict[int, str | None] = {}
    for i, step in enumerate(program):
        lane = step.lane
        if step.action == "fail":
            if pending[lane] is None:
                pending[lane] = f"op {i}"
        elif step.action == "mark":
            last[lane] = i
            result[i], pending[lane] = pending[lane], None
        elif step.action == "remark" and gated and lane in last:
            superseded = result[last[lane]]
            result[last[lane]] = superseded if superseded is not None else pending[lane]
            pending[lane] = None
    return result


def run(program: list[Step], gated: bool) -> dict[int, str | None]:
    stream = ThreadStream("lanes-test")
    contexts = {lane: contextvars.copy_context() for lane in LANES}
    tokens = {lane: contexts[lane].run(enter_lane, stream) for lane in LANES if lane is not None}
    notes: dict[int, HostNotification] = {}
    last: dict[int | None, int] = {}
    gate = HostNotification()
    try:
        if gated:
            stream.enqueue_wait(gate)
        for i, step in enumerate(program):
            ctx = contexts[step.lane]
            if step.action == "ok":
                ctx.run(stream.enqueue, lambda: None)
            elif step.action == "fail":
                ctx.run(stream.enqueue, lambda tag=f"op {i}": fail(tag))
            elif step.action == "mark":
                note = notes[i] = stream.create_notification()
                ctx.run(note.activate)
                last[step.lane] = i
            elif gated and step.lane in last:  # remark: only while the worker is held
                ctx.run(notes[last[step.lane]].activate)
        gate.set()
        reported: dict[int, str | None] = {}
        for i, note in notes.items():
            assert note.wait_on_host(30)
            error = note.error()
            reported[i] = None if error is None else str(error)
        return reported
    finally:
        for lane, token in tokens.items():
            contexts[lane].run(leave_lane, token)
        gate.set()
        stream.close()


@settings(max_examples=150, deadline=None)
@given(program=steps, gated=st.booleans())
def test_each_mark_reports_only_its_own_lane_s_failures(program: list[Step], gated: bool) -> None:
    assert run(program, gated) == expected(program, gated)


def test_work_outside_a_lane_keeps_the_next_mark_rule() -> None:
    # No lane entered: the stream reports a failure at the next mark, whoever records it.
    program = [Step(None, "fail"), Step(None, "mark"), Step(None, "mark")]
    assert run(program, gated=True) == {1: "op 0", 2: None}


def test_a_lane_on_another_stream_changes_nothing_here() -> None:
    stream = ThreadStream("lanes-other")
    other = ThreadStream("lanes-elsewhere")
    ctx = contextvars.copy_context()
    token = ctx.run(enter_lane, other)
    try:
        ctx.run(stream.enqueue, lambda: fail("x"))
        note = stream.create_notification()
        note.activate()  # outside ctx, on the stream the failure is on: it reports it
        assert note.wait_on_host(30)
        assert str(note.error()) == "x"
    finally:
        ctx.run(leave_lane, token)
        stream.close()
        other.close()


def test_leaving_a_lane_from_another_context_is_harmless() -> None:
    stream = ThreadStream("lanes-leave")
    try:
        token = contextvars.copy_context().run(enter_lane, stream)
        leave_lane(token)  # not this context's: nothing to undo here, nothing raised
        leave_lane(token)
    finally:
        stream.close()


@pytest.mark.parametrize("gated", [False, True])
def test_nested_lanes_on_one_stream_report_to_the_innermost(gated: bool) -> None:
    stream = ThreadStream("lanes-nested")
    gate = HostNotification()
    ctx = contextvars.copy_context()
    try:
        if gated:
            stream.enqueue_wait(gate)
        outer = ctx.run(enter_lane, stream)
        ctx.run(stream.enqueue, lambda: fail("outer"))
        inner = ctx.run(enter_lane, stream)
        ctx.run(stream.enqueue, lambda: fail("inner"))
        inner_note = stream.create_notification()
        ctx.run(inner_note.activate)
        ctx.run(leave_lane, inner)
        outer_note = stream.create_notification()
        ctx.run(outer_note.activate)
        ctx.run(leave_lane, outer)
        gate.set()
        assert inner_note.wait_on_host(30)
        assert outer_note.wait_on_host(30)
        assert str(inner_note.error()) == "inner"
        assert str(outer_note.error()) == "outer"
    finally:
        gate.set()
        stream.close()
