"""Arms of one served model (a primary and its candidates), which arm a request goes to, and when a
candidate is rolled back.

    spec = RolloutSpec(arms=(ArmSpec("canary", 0.1, canary_deployment),), rules=RollbackRules())
    arm_for(key, spec.shares(), draw) -> index of the arm (0 = the primary)
    guard = RolloutGuard(spec.names(), spec.rules)
    guard.record(arm, now, latency_s, Outcome.OK)      # every answered request
    guard.check(now) -> [Rollback(...)]                # candidates crossing a rule, once each
    guard.route(arm) -> the arm that serves it          # the primary for a rolled-back candidate

**Assignment.** An arm owns a slice of [0, 1): the primary first, then each candidate in order,
each as wide as its share. A request with a client key (``X-Client-Id``, else its connection) lands
where a 64-bit BLAKE2 hash of the key falls, so a client stays on its arm across requests and
restarts; without a key, where ``draw`` (uniform in [0, 1), the caller's seeded RNG) falls. The
slices never move: a rolled-back candidate's slice is served by the primary (``RolloutGuard.route``),
so every other client keeps its arm.

**Rollback.** Per arm, a sliding window of ``rules.window_s`` seconds (and at most ``MAX_WINDOW``
answers) of outcomes (``Outcome``) and of ok latencies. A candidate is rolled back when, with at
least ``rules.min_samples`` answers in the window on it and on the primary (ok answers, for the
latency rules), its P99 is over ``max_p99_ratio`` times the primary's, its P50 over
``max_p50_ratio`` times (a config much slower for the typical request: at a small share and light
load its tail can stay short while every answer is slow) — each also by more than
``min_latency_gap_s`` in absolute terms —, or its error rate or its rejection rate
exceeds the primary's by more than ``max_error_rate`` / ``max_rejection_rate``; or, whatever the
sample, when it had ``max_faults`` executor faults (model errors, out of memory) in the window. The
primary is never rolled back: it is what traffic returns to. A rolled-back arm stays so until
``enable``.

Pure: no clock, no I/O; ``now`` is always an argument.

Arm assignment (``arm_for``: a stable hash of the client key, else a uniform draw) is the file's first
section.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from batchpilot.core.deployment import DeploymentSpec

# -- Arm assignment --------------------------------------------------------------------------------
# Which arm of a rollout a request lands on: a stable hash of its client key, else a uniform draw,
# in the arms' slices of [0, 1) (``core/rollout.py`` has the whole contract).

def key_point(key: str) -> float:
    """Where a client key falls in [0, 1): a stable hash (the same in every process and run)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def arm_for(key: str | None, shares: Sequence[float], draw: float) -> int:
    """The arm whose slice holds the key's point (or ``draw`` without a key); the primary (0) when the
    point falls past every slice (shares adding up to less than 1 after a rollback)."""
    point = key_point(key) if key is not None else draw
    total = 0.0
    for i, share in enumerate(shares):
        total += share
        if point < total:
            return i
    return 0



PRIMARY = "primary"
ASSIGNMENTS = ("client", "random")


class Outcome(str, Enum):
    OK = "ok"
    ERROR = "error"  # a server-side failure the client saw (5xx other than overload, timeouts)
    REJECTED = "rejected"  # refused by admission (overload, rate limit, infeasible deadline)
    FAULT = "fault"  # the executor failed (model error, out of memory)


@dataclass(frozen=True)
class RollbackRules:
    """When a candidate arm is rolled back (module docstring). ``enabled: false`` only reports."""

    window_s: float = 60.0
    min_samples: int = 50
    max_p99_ratio: float = 1.5
    max_p50_ratio: float = 2.0  # 0 = no P50 rule
    max_error_rate: float = 0.01
    max_rejection_rate: float = 0.05
    max_faults: int = 3
    min_latency_gap_s: float = 0.005  # a latency rule also needs the candidate this much slower
    enabled: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"rollback.enabled must be true or false, got {self.enabled!r}")
        for name in ("min_samples", "max_faults"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"rollback.{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("window_s", "max_p99_ratio", "max_p50_ratio", "max_error_rate", "max_rejection_rate",
                     "min_latency_gap_s"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int | float):
                raise ValueError(f"rollback.{name} must be a number, got {getattr(self, name)!r}")
        if self.window_s <= 0 or self.min_latency_gap_s < 0:
            raise ValueError(f"rollback.window_s must be > 0 and min_latency_gap_s >= 0, got "
                             f"{self.window_s}, {self.min_latency_gap_s}")
        if self.min_samples < 1 or self.max_faults < 1:
            raise ValueError("rollback.min_samples and rollback.max_faults must be >= 1")
        if self.max_p99_ratio <= 1.0:
            raise ValueError(f"rollback.max_p99_ratio must be > 1, got {self.max_p99_ratio}")
        if self.max_p50_ratio and self.max_p50_ratio <= 1.0:
            raise ValueError(f"rollback.max_p50_ratio must be > 1 (or 0: off), got {self.max_p50_ratio}")
        for name in ("max_error_rate", "max_rejection_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"rollback.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class ArmSpec:
    """A candidate arm: its name, its share of the traffic and the deployment it runs."""

    name: str
    share: float
    spec: DeploymentSpec = field(default_factory=DeploymentSpec)

    def __post_init__(self) -> None:
        if not self.name or self.name == PRIMARY or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"arm name {self.name!r}: use letters, digits, '-' or '_' (not {PRIMARY!r})")
        if isinstance(self.share, bool) or not isinstance(self.share, int | float) \
                or not 0.0 <= self.share <= 1.0:
            raise ValueError(f"arm {self.name}: share must be a number in [0, 1], got {self.share!r}")


@dataclass(frozen=True)
class RolloutSpec:
    """The candidates beside the primary deployment, how requests are assigned, and the rollback rules.
    No candidates: one arm, nothing to assign or roll back."""

    arms: tuple[ArmSpec, ...] = ()
    assign: str = "client"
    rules: RollbackRules = field(default_factory=RollbackRules)

    def __post_init__(self) -> None:
        if self.assign not in ASSIGNMENTS:
            raise ValueError(f"rollout.assign = {self.assign!r}; choose one of {', '.join(ASSIGNMENTS)}")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be distinct, got {names}")
        if sum(a.share for a in self.arms) > 1.0 + 1e-9:
            raise ValueError(f"arm shares add up to {sum(a.share for a in self.arms):.3f}; at most 1 "
                             "(the primary takes the rest)")

    def names(self) -> list[str]:
        return [PRIMARY, *(a.name for a in self.arms)]

    def shares(self) -> list[float]:
        """Per arm, primary first: the candidates' shares and the rest for the primary."""
        rest = max(0.0, 1.0 - sum(a.share for a in self.arms))
        return [rest, *(a.share for a in self.arms)]


@dataclass(frozen=True)
class Rollback:
    arm: str
    at: float
    rule: str  # faults | p99_ratio | p50_ratio | error_rate | rejection_rate | manual
    detail: str


@dataclass(frozen=True)
class ArmWindow:
    """One arm's answers in the window: ok latencies, counts by outcome, and its batches."""

    latencies: np.ndarray
    total: int
    errors: int
    rejected: int
    faults: int
    batches: int
    mean_batch_size: float
    padding_efficiency: float

    @property
    def error_rate(self) -> float:
        return (self.errors + self.faults) / self.total if self.total else 0.0

    @property
    def rejection_rate(self) -> float:
        return self.rejected / self.total if self.total else 0.0

    def p(self, q: float) -> float:
        return float(np.quantile(self.latencies, q)) if len(self.latencies) else float("nan")


# a window keeps at most this many answers (and batches) per arm, the newest: a check sorts them,
# and at 1000 answers/s a 60 s window would be 60 000
MAX_WINDOW = 10_000


class _Window:
    def __init__(self) -> None:
        self.answers: deque[tuple[float, float, Outcome]] = deque(maxlen=MAX_WINDOW)
        # at, size, useful tokens, computed tokens
        self.batches: deque[tuple[float, int, int, int]] = deque(maxlen=MAX_WINDOW)

    def trim(self, since: float) -> None:
        while self.answers and self.answers[0][0] < since:
            self.answers.popleft()
        while self.batches and self.batches[0][0] < since:
            self.batches.popleft()


class RolloutGuard:
    """The arms' sliding windows and the rollback decision (module docstring)."""

    def __init__(self, names: Sequence[str], rules: RollbackRules) -> None:
        if not names or names[0] != PRIMARY:
            raise ValueError(f"the first arm is the primary ({PRIMARY!r}), got {list(names)}")
        self.rules = rules
        self.names = list(names)
        self._windows = {n: _Window() for n in names}
        self.rolled_back: dict[str, Rollback] = {}

    def record(self, arm: str, now: float, latency_s: float, outcome: Outcome) -> None:
        w = self._windows[arm]
        w.answers.append((now, latency_s, outcome))
        w.trim(now - self.rules.window_s)

    def record_batch(self, arm: str, now: float, size: int, useful_tokens: int, computed_tokens: int) -> None:
        w = self._windows[arm]
        w.batches.append((now, size, useful_tokens, computed_tokens))
        w.trim(now - self.rules.window_s)

    def window(self, arm: str, now: float) -> ArmWindow:
        w = self._windows[arm]
        w.trim(now - self.rules.window_s)
        counts = {o: 0 for o in Outcome}
        lat = []
        for _, latency, outcome in w.answers:
            counts[outcome] += 1
            if outcome is Outcome.OK:
                lat.append(latency)
        sizes = [b[1] for b in w.batches]
        useful = sum(b[2] for b in w.batches)
        computed = sum(b[3] for b in w.batches)
        return ArmWindow(np.asarray(lat, dtype=float), len(w.answers), counts[Outcome.ERROR],
                         counts[Outcome.REJECTED], counts[Outcome.FAULT], len(sizes),
                         float(np.mean(sizes)) if sizes else float("nan"),
                         useful / computed if computed else float("nan"))

    def check(self, now: float) -> list[Rollback]:
        """Candidates crossing a rule now (each reported once; they stay rolled back until ``enable``).
        With ``rules.enabled`` off nothing is rolled back."""
        if not self.rules.enabled:
            return []
        r = self.rules
        primary = self.window(PRIMARY, now)
        out = []
        for name in self.names[1:]:
            if name in self.rolled_back:
                continue
            cand = self.window(name, now)
            found = self._crossed(primary, cand)
            if found is not None:
                rb = Rollback(name, now, found[0], found[1] + f" over the last {r.window_s:.0f} s")
                self.rolled_back[name] = rb
                out.append(rb)
        return out

    def _crossed(self, primary: ArmWindow, cand: ArmWindow) -> tuple[str, str] | None:
        r = self.rules
        if cand.faults >= r.max_faults:
            return "faults", f"{cand.faults} executor faults (limit {r.max_faults})"
        if min(cand.total, primary.total) < r.min_samples:
            return None
        if min(len(cand.latencies), len(primary.latencies)) >= r.min_samples:  # latency: ok answers
            gap = r.min_latency_gap_s  # sub-millisecond arms differ 2x on noise alone
            ratio = cand.p(0.99) / max(primary.p(0.99), 1e-9)
            if ratio > r.max_p99_ratio and cand.p(0.99) - primary.p(0.99) > gap:
                return "p99_ratio", (f"P99 {cand.p(0.99) * 1e3:.0f} ms is {ratio:.2f}x the primary's "
                                     f"{primary.p(0.99) * 1e3:.0f} ms (limit {r.max_p99_ratio}x)")
            ratio = cand.p(0.5) / max(primary.p(0.5), 1e-9)
            if r.max_p50_ratio and ratio > r.max_p50_ratio and cand.p(0.5) - primary.p(0.5) > gap:
                return "p50_ratio", (f"P50 {cand.p(0.5) * 1e3:.0f} ms is {ratio:.2f}x the primary's "
                                     f"{primary.p(0.5) * 1e3:.0f} ms (limit {r.max_p50_ratio}x)")
        if cand.error_rate - primary.error_rate > r.max_error_rate:
            return "error_rate", (f"error rate {cand.error_rate:.1%} vs the primary's "
                                  f"{primary.error_rate:.1%} (limit +{r.max_error_rate:.1%})")
        if cand.rejection_rate - primary.rejection_rate > r.max_rejection_rate:
            return "rejection_rate", (f"rejection rate {cand.rejection_rate:.1%} vs the primary's "
                                      f"{primary.rejection_rate:.1%} (limit +{r.max_rejection_rate:.1%})")
        return None

    def enable(self, arm: str) -> bool:
        """Take a rolled-back arm back; its window starts empty. False if it was not rolled back."""
        if self.rolled_back.pop(arm, None) is None:
            return False
        self._windows[arm] = _Window()
        return True

    def route(self, arm: int) -> int:
        """The arm that serves a request assigned to ``arm``: the primary for a rolled-back candidate."""
        return 0 if arm and self.names[arm] in self.rolled_back else arm

    def shares(self, base: Sequence[float]) -> list[float]:
        """The shares served: ``base`` with each rolled-back candidate's moved to the primary."""
        out = list(base)
        for i, name in enumerate(self.names):
            if i and name in self.rolled_back:
                out[0] += out[i]
                out[i] = 0.0
        return out
