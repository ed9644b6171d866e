"""RequestQueue: the three orders, bounds, cancel, expiry, cached aggregates, and a model check."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.queue import RequestQueue
from core_factories import make_request


def ids(reqs: list) -> list[int]:  # type: ignore[type-arg]
    return [r.id for r in reqs]


def test_fcfs_orders_by_arrival_even_if_submitted_out_of_order() -> None:
    q = RequestQueue("fcfs")
    a, b, c = make_request(arrival=1.0), make_request(arrival=0.5), make_request(arrival=2.0)
    for r in (a, b, c):
        q.push(r)
    assert ids(q.peek(3)) == [b.id, a.id, c.id]
    assert q.head() is b and q.oldest() is b


def test_priority_then_arrival() -> None:
    q = RequestQueue("priority")
    low_old = make_request(arrival=0.0, priority=1)
    high_new = make_request(arrival=2.0, priority=-1)
    mid = make_request(arrival=1.0, priority=0)
    mid_later = make_request(arrival=1.5, priority=0)
    for r in (low_old, mid_later, high_new, mid):
        q.push(r)
    assert ids(q.peek(10)) == [high_new.id, mid.id, mid_later.id, low_old.id]
    assert q.oldest() is low_old  # the window is measured from the oldest, whatever its priority


def test_edf_puts_requests_without_deadline_last() -> None:
    q = RequestQueue("edf")
    none = make_request(arrival=0.0)
    late = make_request(arrival=0.1, deadline=5.0)
    soon = make_request(arrival=0.2, deadline=1.0)
    for r in (none, late, soon):
        q.push(r)
    assert ids(q.peek(3)) == [soon.id, late.id, none.id]
    assert q.most_urgent() is soon


def test_bounded_push_refuses_at_capacity() -> None:
    q = RequestQueue("fcfs", capacity=2)
    assert q.push(make_request()) and q.push(make_request())
    assert q.is_full()
    assert not q.push(make_request())
    assert len(q) == 2


def test_duplicate_id_is_an_error() -> None:
    q = RequestQueue()
    q.push(make_request(id=7))
    with pytest.raises(ValueError, match="already waiting"):
        q.push(make_request(id=7))


def test_cancel_and_take_update_aggregates() -> None:
    q = RequestQueue("priority")
    reqs = [make_request(length=n, arrival=float(i)) for i, n in enumerate((10, 300, 20, 40))]
    for r in reqs:
        q.push(r)
    assert q.num_tokens == 370 and q.max_length() == 300
    assert q.remove(reqs[1].id) is reqs[1]
    assert q.remove(reqs[1].id) is None
    assert q.num_tokens == 70 and q.max_length() == 40
    q.take(q.peek(2))
    assert ids(list(q)) == [reqs[3].id]
    assert q.num_tokens == 40 and q.oldest() is reqs[3]


def test_expire_is_inclusive_of_now_and_keeps_the_rest() -> None:
    q = RequestQueue("fcfs")
    a = make_request(deadline=1.0)
    b = make_request(deadline=2.0)
    c = make_request()
    for r in (a, b, c):
        q.push(r)
    assert q.expire(0.5) == []
    assert q.expire(1.0) == [a]  # exactly at the deadline: gone, so a wake-up at it makes progress
    assert ids(list(q)) == [b.id, c.id]
    assert q.most_urgent() is b


def test_due_before_lists_deadlines_in_order() -> None:
    q = RequestQueue("fcfs")
    reqs = [make_request(deadline=d) for d in (3.0, 1.0, 2.0, 9.0)]
    for r in reqs:
        q.push(r)
    q.remove(reqs[2].id)
    assert ids(q.due_before(3.5)) == [reqs[1].id, reqs[0].id]


def test_new_urgent_request_enters_the_peeked_front() -> None:
    q = RequestQueue("priority")
    for i in range(5):
        q.push(make_request(arrival=float(i)))
    q.peek(3)  # the first three now sit in the front list
    urgent = make_request(arrival=9.0, priority=-5)
    q.push(urgent)
    assert q.peek(1) == [urgent]
    assert q.head() is urgent


def test_stale_entries_are_compacted() -> None:
    q = RequestQueue("fcfs")
    reqs = [make_request(arrival=float(i)) for i in range(2000)]
    for r in reqs:
        q.push(r)
    for r in reqs[1000:1990]:  # cancel from the middle: lazy deletions in the heap
        q.remove(r.id)
    assert len(q) == 1010
    assert len(q._heap) <= 2 * len(q) + 64  # rebuilt, not left to grow
    assert ids(q.peek(1010)) == ids(reqs[:1000] + reqs[1990:])


ops = st.lists(st.tuples(st.sampled_from(["push", "push", "push", "cancel", "take", "peek", "expire"]),
                         st.integers(0, 3), st.integers(1, 50), st.floats(0, 10)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(order=st.sampled_from(["fcfs", "priority", "edf"]), script=ops)
def test_queue_matches_a_sorted_list_model(order: str, script: list[tuple[str, int, int, float]]) -> None:
    """Every operation against a naive model: a list kept in the order's key."""
    work = [0.001 * (1 + x % 7) for x in range(51)]  # per length: any table
    q = RequestQueue(order, work_s=work)  # type: ignore[arg-type]
    model: list = []  # type: ignore[type-arg]
    seq_of: dict[int, int] = {}
    now = 0.0

    def key(r):  # type: ignore[no-untyped-def]
        dl = math.inf if r.deadline is None else r.deadline
        k0 = {"fcfs": r.arrival, "priority": r.priority, "edf": dl}[order]
        return (k0, r.arrival if order != "fcfs" else 0.0, seq_of[r.id])

    for op, a, b, t in script:
        if op == "push":
            r = make_request(length=b, arrival=t, priority=a - 1, deadline=t + b / 10 if a % 2 else None)
            seq_of[r.id] = len(seq_of)
            q.push(r)
            model.append(r)
        elif op == "cancel" and model:
            victim = model[b % len(model)]
            assert q.remove(victim.id) is victim
            model.remove(victim)
        elif op == "take" and model:
            got = q.peek(a + 1)
            q.take(got[::2])
            for r in got[::2]:
                model.remove(r)
        elif op == "expire":
            now = max(now, t)
            gone = q.expire(now)
            expect = [r for r in model if r.deadline is not None and r.deadline <= now]
            assert {r.id for r in gone} == {r.id for r in expect}
            model = [r for r in model if r not in expect]
        model.sort(key=key)
        assert ids(q.peek(b)) == ids(model[:b])
        assert len(q) == len(model)
        assert q.num_tokens == sum(r.length for r in model)
        assert q.num_work_s == pytest.approx(sum(work[r.length] for r in model), abs=1e-12)
        assert q.num_work_s == 0.0 or model  # exactly 0 once empty
        assert q.max_length() == max((r.length for r in model), default=0)
        if model:
            assert q.oldest().arrival == min(r.arrival for r in model)  # type: ignore[union-attr]
        with_dl = [r.deadline for r in model if r.deadline is not None]
        urgent = q.most_urgent()
        assert (urgent.deadline if urgent else None) == (min(with_dl) if with_dl else None)
