"""The simulator's LLM target admits and expires requests by the core's rules, as the live engine does,
and counts a refused or expired request the way the load generator counts an error answer."""

from __future__ import annotations

import argparse

from batchpilot.core.deployment import resolve_llm_deployment
from batchpilot.core.llm.admission import LLMAdmission
from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.core.llm.sequence import SamplingParams, Sequence
from batchpilot.settings import add_deployment_args, add_llm_args, spec_from_args
from batchpilot.sim.engine import Engine
from batchpilot.sim.llm import LLMTarget, default_llm_cost_model, simulate_llm
from batchpilot.sim.traces import Workload

SMALL = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "num_kv_blocks": 256, "block_size": 16}


def burst(n: int, at: float = 0.0, output: int = 20) -> Workload:
    return Workload.from_columns("burst", [at] * n, [32] * n, [output] * n)


def test_the_simulator_refuses_what_passes_the_waiting_bound_as_the_server_answers_503() -> None:
    cfg = LLMSchedulerConfig(**SMALL, max_waiting_seqs=3)  # at most 2 + 3 sequences admitted
    rep = simulate_llm(burst(12), cfg).report()
    assert rep.num_rejected == 7 and rep.rejected_by_reason == {"queue_full": 7}
    assert rep.num_finished == 5
    assert any("queue_full 7" in value for _, value in rep.rows())
    roomy = simulate_llm(burst(12), LLMSchedulerConfig(**SMALL)).report()  # the default bound: 2 + 256
    assert roomy.num_rejected == 0 and roomy.num_finished == 12


def test_the_simulator_refuses_the_requests_the_core_refuses_in_arrival_order() -> None:
    cfg = LLMSchedulerConfig(**SMALL, max_waiting_seqs=1)
    wl = Workload.from_columns("w", [0.0, 0.0, 0.0, 0.0, 60.0], [32] * 5, [20] * 5)
    run = simulate_llm(wl, cfg)
    adm = LLMAdmission(cfg)  # the same calls by hand: three admitted, the fourth refused
    expect = [adm.admit([Sequence(i, [3] * 32, SamplingParams(max_tokens=20), arrival=0.0)])
              for i in range(4)]
    assert [r is not None for r in expect] == [False, False, False, True]
    assert run.record.rejected == [None, None, None, "queue_full", None]  # by 60 s the queue has drained


def test_a_request_past_the_request_timeout_expires_and_frees_its_blocks() -> None:
    cfg = LLMSchedulerConfig(**SMALL, request_timeout_s=0.5)
    wl = burst(6, output=200)  # far longer than 0.5 s on the default cost model
    sched = LLMScheduler(cfg)
    target = LLMTarget(sched, wl, default_llm_cost_model())
    stats = Engine(target, num_slots=1).run(wl.arrival_s)  # type: ignore[arg-type]
    rec = target.record
    assert not stats.stalled and rec.rejected == ["timeout"] * 6
    assert any(n > 0 for n in rec.num_output)  # some had streamed tokens: still not served
    assert sched.block_manager.num_free_blocks == 256 and target.admission.num_admitted == 0
    assert all(t >= 0.5 for t in rec.finish_s)  # each at the first step after its deadline


def test_the_flags_the_server_takes_make_the_simulator_predict_its_refusals() -> None:
    p = argparse.ArgumentParser()
    add_deployment_args(p)
    add_llm_args(p)
    spec = spec_from_args(p.parse_args(["--max-num-seqs", "2", "--max-concurrency", "4",
                                        "--request-timeout-s", "1000"]))
    config = resolve_llm_deployment(spec).config
    assert (config.max_waiting_seqs, config.request_timeout_s) == (2, 1000.0)
    rep = simulate_llm(burst(10), config).report()
    assert rep.rejected_by_reason == {"queue_full": 6} and rep.num_finished == 4
