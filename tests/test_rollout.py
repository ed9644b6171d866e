"""core.rollout: which arm a request goes to, and when a candidate is rolled back (fake clock)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.rollout import (
    PRIMARY,
    ArmSpec,
    Outcome,
    RollbackRules,
    RolloutGuard,
    RolloutSpec,
    arm_for,
    key_point,
)
from batchpilot.settings import (
    add_deployment_args,
    add_rollout_args,
    load_rollout,
    load_spec,
    rollout_from_args,
    spec_from_args,
)


def two_arms(share: float = 0.1, **rules: object) -> RolloutSpec:
    return RolloutSpec((ArmSpec("canary", share, DeploymentSpec()),), rules=RollbackRules(**rules))  # type: ignore[arg-type]


def test_a_client_key_always_lands_on_the_same_arm() -> None:
    shares = two_arms(0.5).shares()
    for i in range(200):
        key = f"client-{i}"
        assert len({arm_for(key, shares, draw) for draw in (0.0, 0.5, 0.999)}) == 1


def test_the_hash_point_is_the_same_in_every_process() -> None:
    assert key_point("client-1") == pytest.approx(int.from_bytes(
        __import__("hashlib").blake2b(b"client-1", digest_size=8).digest(), "big") / 2**64)


def test_without_a_key_the_draw_picks_the_arm() -> None:
    shares = [0.9, 0.1]
    assert arm_for(None, shares, 0.05) == 0
    assert arm_for(None, shares, 0.95) == 1


def test_keys_split_in_proportion_to_the_shares() -> None:
    shares = two_arms(0.2).shares()
    on_canary = sum(arm_for(f"user{i}", shares, 0.0) for i in range(20_000)) / 20_000
    assert on_canary == pytest.approx(0.2, abs=0.015)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 0.3), min_size=1, max_size=3), st.integers(0, 2))
def test_rolling_back_one_candidate_moves_only_its_clients(cand: list[float], victim: int) -> None:
    names = [PRIMARY, *(f"arm{i}" for i in range(len(cand)))]
    victim = 1 + victim % len(cand)
    guard = RolloutGuard(names, RollbackRules())
    base = [1.0 - sum(cand), *cand]
    before = {k: arm_for(k, base, 0.0) for k in (f"k{i}" for i in range(500))}
    guard.rolled_back[names[victim]] = None  # type: ignore[assignment]
    after_shares = guard.shares(base)
    assert after_shares[victim] == 0.0 and sum(after_shares) == pytest.approx(sum(base))
    for key, arm in before.items():
        assert guard.route(arm_for(key, base, 0.0)) == (0 if arm == victim else arm)


def test_arm_specs_are_validated() -> None:
    with pytest.raises(ValueError, match="share"):
        ArmSpec("x", 1.5)
    with pytest.raises(ValueError, match="name"):
        ArmSpec(PRIMARY, 0.1)
    with pytest.raises(ValueError, match="add up"):
        RolloutSpec((ArmSpec("a", 0.6), ArmSpec("b", 0.6)))
    with pytest.raises(ValueError, match="distinct"):
        RolloutSpec((ArmSpec("a", 0.1), ArmSpec("a", 0.1)))
    with pytest.raises(ValueError, match="assign"):
        RolloutSpec(assign="sticky")
    with pytest.raises(ValueError, match="max_p99_ratio"):
        RollbackRules(max_p99_ratio=0.9)
    with pytest.raises(ValueError, match="true or false"):
        RollbackRules(enabled="flase")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="integer"):
        RollbackRules(min_samples=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="share"):
        ArmSpec("x", True)


def feed(guard: RolloutGuard, arm: str, t0: float, n: int, latency: float, outcome: Outcome = Outcome.OK,
         dt: float = 0.01) -> float:
    for i in range(n):
        guard.record(arm, t0 + i * dt, latency, outcome)
    return t0 + n * dt


def test_a_candidate_much_slower_than_the_primary_is_rolled_back_once_both_have_the_sample() -> None:
    guard = RolloutGuard([PRIMARY, "canary"], RollbackRules(min_samples=50, max_p99_ratio=1.5))
    t = feed(guard, PRIMARY, 0.0, 200, 0.010)
    t = feed(guard, "canary", t, 49, 0.100)
    assert guard.check(t) == []  # 49 < min_samples: no verdict yet
    t = feed(guard, "canary", t, 1, 0.100)
    [rb] = guard.check(t)
    assert rb.arm == "canary" and rb.rule == "p99_ratio" and "10.00x" in rb.detail
    assert guard.check(t + 1) == []  # reported once
    assert guard.shares([0.9, 0.1]) == [1.0, 0.0]


def test_a_candidate_slower_for_the_typical_request_is_rolled_back_on_its_p50() -> None:
    guard = RolloutGuard([PRIMARY, "canary"], RollbackRules(min_samples=50, max_p99_ratio=1.5,
                                                            max_p50_ratio=2.0))
    t = feed(guard, PRIMARY, 0.0, 98, 0.010)
    t = feed(guard, PRIMARY, t, 2, 0.500)  # a burst: the primary's tail is long
    t = feed(guard, "canary", t, 100, 0.030)  # three times slower, but no tail
    [rb] = guard.check(t)
    assert rb.rule == "p50_ratio" and "3.00x" in rb.detail
    off = RolloutGuard([PRIMARY, "canary"], RollbackRules(min_samples=50, max_p50_ratio=0.0))
    t = feed(off, PRIMARY, feed(off, PRIMARY, 0.0, 98, 0.010), 2, 0.500)
    assert off.check(feed(off, "canary", t, 100, 0.030)) == []


def test_sub_millisecond_arms_twice_apart_are_kept_unless_the_gap_is_set_to_zero() -> None:
    for gap, expected in ((0.005, []), (0.0, ["p99_ratio"])):
        guard = RolloutGuard([PRIMARY, "canary"], RollbackRules(min_samples=50, min_latency_gap_s=gap))
        t = feed(guard, PRIMARY, 0.0, 200, 0.0002)
        t = feed(guard, "canary", t, 200, 0.0005)  # 2.5x, but 0.3 ms: noise on a cold process
        assert [rb.rule for rb in guard.check(t)] == expected


def test_a_candidate_as_fast_as_the_primary_is_kept() -> None:
    guard = RolloutGuard([PRIMARY, "canary"], RollbackRules(min_samples=50))
    t = feed(guard, PRIMARY, 0.0, 500, 0.010)
    t = feed(guard, "canary", t, 500, 0.012)
    assert guard.check(t) == []


def test_faults_roll_back_whatever_the_sample() -> None:
    guard = RolloutGuard([PRIMARY, "canary"], RollbackRules(max_faults=3))
    t = feed(guard, "canary", 0.0, 2, 0.0, Outcome.FAULT)
    assert guard.check(t) == []
    t = feed(guard, "canary", t, 1, 0.0, Outcome.FAULT)
    [rb] = guard.check(t)
    assert rb.rule == "faults"


def test_error_and_rejection_rates_are_compared_with_the_primarys() -> None:
    rules = RollbackRules(min_samples=100, max_error_rate=0.02, max_rejection_rate=0.05)
    guard = RolloutGuard([PRIMARY, "canary", "busy"], rules)
    t = feed(guard, PRIMARY, 0.0, 100, 0.01)
    t = feed(guard, PRIMARY, t, 3, 0.0, Outcome.REJECTED)
    t = feed(guard, "canary", t, 95, 0.01)
    t = feed(guard, "canary", t, 5, 0.0, Outcome.ERROR)
    t = feed(guard, "busy", t, 90, 0.01)
    t = feed(guard, "busy", t, 10, 0.0, Outcome.REJECTED)
    rules_hit = {rb.arm: rb.rule for rb in guard.check(t)}
    assert rules_hit == {"canary": "error_rate", "busy": "rejection_rate"}


def test_answers_older_than_the_window_do_not_count() -> None:
    guard = RolloutGuard([PRIMARY, "canary"], RollbackRules(window_s=10, min_samples=50, max_faults=3))
    feed(guard, "canary", 0.0, 3, 0.0, Outcome.FAULT)
    assert guard.window("canary", 11.0).total == 0
    assert guard.check(11.0) == []


def test_the_primary_is_never_rolled_back_and_enable_restores_a_candidate() -> None:
    guard = RolloutGuard([PRIMARY, "canary"], RollbackRules(max_faults=1))
    feed(guard, PRIMARY, 0.0, 10, 0.0, Outcome.FAULT)
    assert guard.check(1.0) == []
    feed(guard, "canary", 1.0, 1, 0.0, Outcome.FAULT)
    assert [rb.arm for rb in guard.check(2.0)] == ["canary"]
    assert guard.enable("canary") and not guard.enable("canary")
    assert guard.window("canary", 2.0).total == 0
    assert guard.shares([0.9, 0.1]) == [0.9, 0.1]


def test_rules_disabled_only_report() -> None:
    guard = RolloutGuard([PRIMARY, "canary"], RollbackRules(max_faults=1, enabled=False))
    feed(guard, "canary", 0.0, 5, 0.0, Outcome.FAULT)
    assert guard.check(1.0) == []
    assert guard.window("canary", 1.0).faults == 5


def test_batches_in_the_window_give_size_and_padding() -> None:
    guard = RolloutGuard([PRIMARY], RollbackRules(window_s=5))
    guard.record_batch(PRIMARY, 0.0, 8, 800, 1000)
    guard.record_batch(PRIMARY, 1.0, 4, 200, 1000)
    w = guard.window(PRIMARY, 2.0)
    assert w.batches == 2 and w.mean_batch_size == 6 and w.padding_efficiency == pytest.approx(0.5)
    assert guard.window(PRIMARY, 5.5).batches == 1


def write(path: Any, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_the_arms_section_reads_files_and_inline_sections(tmp_path: Path) -> None:
    write(tmp_path / "b.yaml", "encoder:\n  policy: {name: window, max_batch_size: 1}\n")
    a = write(tmp_path / "a.yaml", """\
encoder:
  policy: {name: hybrid, max_batch_size: 32}
server: {max_concurrency: 64}
arms:
  assign: random
  candidates:
    - {name: slow, share: 0.1, config: b.yaml}
    - {name: wide, share: 0.2, encoder: {policy: {name: hybrid, max_batch_size: 64}}}
  rollback: {max_p99_ratio: 2.0, min_samples: 20}
""")
    primary = load_spec(a)  # the arms section is not part of the primary's deployment
    assert primary.encoder.policy.max_batch_size == 32
    rollout = load_rollout(a, primary)
    assert rollout.assign == "random" and rollout.names() == [PRIMARY, "slow", "wide"]
    assert rollout.shares() == pytest.approx([0.7, 0.1, 0.2])
    slow, wide = (arm.spec for arm in rollout.arms)
    assert slow.encoder.policy.max_batch_size == 1 and slow.server.max_concurrency == 64  # the primary's
    assert wide.encoder.policy.max_batch_size == 64 and wide.server.max_concurrency == 64  # inherits
    assert rollout.rules.max_p99_ratio == 2.0 and rollout.rules.min_samples == 20


@pytest.mark.parametrize(("arms", "error"), [
    ("arms: [1, 2]", "expected a mapping"),
    ("arms: {candidates: [{name: x}]}", "a name and a share"),
    ("arms: {shares: 1}", "unknown key"),
    ("arms: {candidates: [{name: x, share: 0.1}], rollback: {max_p99: 2}}", "unknown key"),
    ("arms: {candidates: [{name: x, share: 0.1, config: b.yaml, encoder: {}}]}", "not both"),
])
def test_a_wrong_arms_section_is_an_error_naming_the_file(tmp_path: Path, arms: str, error: str) -> None:
    write(tmp_path / "b.yaml", "")
    path = write(tmp_path / "a.yaml", arms + "\n")
    with pytest.raises(ValueError, match=error) as info:
        load_rollout(path)
    assert "a.yaml" in str(info.value)


def test_the_canary_flags_add_an_arm_and_set_the_rules(tmp_path: Path) -> None:
    canary = write(tmp_path / "b.yaml", "encoder:\n  policy: {max_batch_size: 4}\n")
    parser = argparse.ArgumentParser()
    add_deployment_args(parser)
    add_rollout_args(parser)
    args = parser.parse_args(["--canary", canary, "--canary-share", "0.25", "--rollback-p99-ratio", "3",
                              "--no-rollback", "--arm-assign", "random"])
    rollout = rollout_from_args(args, spec_from_args(args))
    assert [(a.name, a.share) for a in rollout.arms] == [("canary", 0.25)]
    assert rollout.arms[0].spec.encoder.policy.max_batch_size == 4
    assert rollout.rules.max_p99_ratio == 3 and not rollout.rules.enabled and rollout.assign == "random"
    with pytest.raises(SystemExit):
        rollout_from_args(parser.parse_args(["--canary-share", "0.2"]), DeploymentSpec())
