"""Random LLM workloads for the scheduler property tests: the strategy, the admission order the docs
state, and the arrivals a test loop adds at each step (one second per step)."""

from __future__ import annotations

from hypothesis import strategies as st

from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.core.llm.sequence import SamplingParams, Sequence

Work = list[tuple[int, int, int, int, bool]]  # (prompt length, max_tokens, priority, arrival step, abort)

workload = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(0, 6),
              st.booleans()),
    min_size=1, max_size=14,
)


def rule_key(q: Sequence, now: float, policy: str, wait: float) -> tuple[float, ...]:
    """The order the docs state, written independently of the scheduler: FCFS; or priority, except that
    a sequence that has waited ``wait`` seconds (> 0) goes ahead of every younger one, oldest first."""
    if policy == "fcfs":
        return (q.arrival, q.seq_id)
    if wait > 0 and now - q.arrival >= wait:
        return (0, 0, q.arrival, q.seq_id)
    return (1, q.priority, q.arrival, q.seq_id)


class Arrivals:
    """A workload's sequences, not yet added, in arrival order; ``admitted`` the ones the scheduler took."""

    def __init__(self, work: Work) -> None:
        self.pending = sorted(enumerate(work), key=lambda x: x[1][3])
        self.admitted: list[Sequence] = []

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add_due(self, s: LLMScheduler, step: int) -> None:
        """Add every sequence whose arrival step has come; abort some of them right after admission."""
        pending = self.pending
        while pending and pending[0][1][3] <= step:
            i, (plen, mtok, prio, at, abort) = pending.pop(0)
            q = Sequence(i, [7 + (i % 2)] * plen, SamplingParams(max_tokens=mtok, ignore_eos=True),
                         arrival=float(at), priority=prio)
            if s.add(q) is None:
                self.admitted.append(q)
                if abort and i % 3 == 0:
                    s.abort(i)
