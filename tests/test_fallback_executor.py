"""runtime/executor.py: repeated primary failures move batches to the padded fallback, a poison
input never does, and a probe batch brings the primary back (fake clock)."""

from __future__ import annotations

from typing import Any

import pytest

from batchpilot.core.batch import Batch
from batchpilot.core.breaker import BreakerConfig
from batchpilot.core.costmodel import BatchShape
from batchpilot.core.request import Request
from batchpilot.runtime.executor import FallbackExecutor, padded

POISON = 99


class Path:
    """An executor that records the batches it prepared; ``broken`` makes every run raise."""

    def __init__(self, name: str) -> None:
        self.name, self.broken, self.padding_seen = name, False, []  # type: ignore[var-annotated]
        self.model_name = f"{name}-model"

    def prepare(self, batch: Batch) -> list[int]:
        self.padding_seen.append((batch.padding, batch.padded_len))
        return [r.payload for r in batch.requests]

    def run(self, payloads: list[int]) -> list[Any]:
        if self.broken or POISON in payloads:
            raise RuntimeError(f"{self.name} failed")
        return [(self.name, p) for p in payloads]


def batch(*payloads: int, padding: str = "none", bid: int = 0) -> Batch:
    reqs = [Request(i, 0.0, length=3 + i, payload=p) for i, p in enumerate(payloads)]
    return Batch(bid, reqs, 0, BatchShape.padded([r.length for r in reqs], 0), padding, 0.0)


def make(threshold: int = 2) -> tuple[FallbackExecutor, Path, Path, list[float]]:
    primary, fallback, now = Path("ragged"), Path("padded"), [0.0]
    breaker = BreakerConfig(failure_threshold=threshold, probe_interval_s=10.0)
    ex = FallbackExecutor(primary, fallback, breaker, clock=lambda: now[0])
    return ex, primary, fallback, now


def run(ex: FallbackExecutor, b: Batch) -> list[Any]:
    return ex.run(ex.prepare(b))


def test_a_failed_primary_batch_is_answered_by_the_fallback_padded_to_its_longest_input() -> None:
    ex, primary, fallback, _ = make()
    primary.broken = True
    assert run(ex, batch(1, 2)) == [("padded", 1), ("padded", 2)]
    assert fallback.padding_seen == [("dynamic", 4)] and ex.num_primary_failures == 1
    assert not ex.fallback_active  # one failure: under the threshold


def test_repeated_failures_open_the_breaker_and_a_probe_brings_the_primary_back() -> None:
    ex, primary, fallback, now = make(threshold=2)
    primary.broken = True
    run(ex, batch(1))
    run(ex, batch(2))
    assert ex.fallback_active
    primary.broken = False
    assert run(ex, batch(3)) == [("padded", 3)]  # open: the primary is not tried
    assert len(primary.padding_seen) == 2
    now[0] = 10.0
    assert run(ex, batch(4)) == [("ragged", 4)]  # the probe batch
    assert not ex.fallback_active and run(ex, batch(5)) == [("ragged", 5)]


def test_a_failed_probe_keeps_the_fallback_and_backs_off() -> None:
    ex, primary, _, now = make(threshold=1)
    primary.broken = True
    run(ex, batch(1))
    now[0] = 10.0
    assert run(ex, batch(2)) == [("padded", 2)]  # probe failed, answered by the fallback
    assert ex.fallback_active and ex.breaker.probe_at == 30.0


def test_a_poison_input_fails_on_both_paths_and_never_opens_the_breaker() -> None:
    ex, _, _, _ = make(threshold=1)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="ragged failed"):  # the primary's error: the Batcher bisects
            run(ex, batch(POISON, 1))
    assert not ex.fallback_active and ex.num_primary_failures == 0


def test_padded_batches_stay_as_they_are_and_the_rest_is_the_primarys() -> None:
    b = batch(1, padding="dynamic")
    assert padded(b) is b
    ex, _, _, _ = make()
    assert ex.model_name == "ragged-model"


def test_a_broken_padding_free_encoder_path_falls_back_to_the_padded_fp32_path_of_the_same_model() -> None:
    import numpy as np

    from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, make_batch

    primary = EncoderExecutor(EncoderConfig(device="cpu", num_threads=1))  # lean + ragged (padding-free)
    plain = EncoderExecutor(EncoderConfig(device="cpu", num_threads=1, lean_forward=False))  # HF, padded
    assert primary.supports_padding_free()
    ex = FallbackExecutor(primary, plain, BreakerConfig(failure_threshold=1, probe_interval_s=60.0))
    ids = primary.tokenize(["a short text", "a somewhat longer text about batching inputs together"])
    reference = run(ex, make_batch(ids, "none", primary.max_length))

    def broken(*args: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    primary._run_ragged = broken  # type: ignore[method-assign]
    answered = run(ex, make_batch(ids, "none", primary.max_length, batch_id=1))
    assert ex.fallback_active and ex.num_primary_failures == 1
    for got, want in zip(answered, reference, strict=True):
        cos = float(np.dot(got, want) / (np.linalg.norm(got) * np.linalg.norm(want)))
        assert cos > 0.9999
    assert len(run(ex, make_batch(ids, "none", primary.max_length, batch_id=2))) == 2  # open: the fallback
    assert ex.num_fallback_batches == 2
