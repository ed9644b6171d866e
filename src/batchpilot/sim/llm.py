"""The LLM target: the real ``LLMScheduler`` in the simulator's event loop, each step timed by a cost model.

One slot (one engine), one job per iteration (docs/simulator.md): ``schedule`` asks the scheduler for a
step and returns ``Job(frontend.step_seconds(price, seqs, prefill), plan)``, ``price`` the step model's
line times the step profile's measured shape (``sim.llm_step_shape.StepPricer``), ``prefill`` whether
the step carries a prefill chunk (the serving path's step terms, ``sim.llm_frontend``; nothing added
without one); when the job ends,
``on_job_done`` feeds ``update`` a dummy token for every sampling chunk (EOS is ignored, as in
conv-llm, so only lengths matter), and records first-token and finish times. The scheduler, block
manager, budgets and preemption are the ones the live engine runs, so TTFT and TPOT predicted here
follow the same policy.

Admission and deadlines are the live engine's (``core/llm_admission.py``): each arrival is one request
of one prompt, admitted by ``LLMAdmission.admit`` (refused when it never fits, 400, or when
``max_num_seqs + max_waiting_seqs`` sequences are already admitted, 503) with the routes' deadline
(``request_deadline``: arrival + ``request_timeout_s``); before each step ``LLMScheduler.expire(now)``
ends the sequences past it (504). A refused or expired request counts in ``rejected`` (its reason: the
server's error code), not as finished, as the load generator counts an error answer or error event.

Preemption by swap: the scheduler gets the same ``PreemptionCosts`` the step is priced with, and a step
that swaps costs ``cost_model.latency(plan.shape)`` plus its block copies
(``PreemptionCosts.swap_s(len(plan.swap_out), len(plan.swap_in))``). The copy figures come from the
profile's ``meta`` (``profile_llm_steps`` on a runner with swap space), else the stated default below.

Prompts are made of distinct token ids per request so the prefix cache (when enabled) never hits by
accident.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchpilot.core.costmodel import LLM_FEATURES, CostModel
from batchpilot.core.llm_admission import NEVER_FITS, TIMEOUT, LLMAdmission, request_deadline
from batchpilot.core.llm_scheduler import LLMScheduler, LLMSchedulerConfig, StepPlan
from batchpilot.core.preemption import SWAP_META_KEYS, PreemptionCosts, PreemptionCounters
from batchpilot.core.sequence import SamplingParams, Sequence
from batchpilot.sim.engine import Engine, EngineStats, Job
from batchpilot.sim.llm_frontend import LLMFrontEnd
from batchpilot.sim.llm_report import LLMRecord, LLMSimReport, summarize_llm
from batchpilot.sim.llm_step_shape import StepPricer
from batchpilot.sim.traces import Workload


def default_llm_cost_model() -> CostModel:
    """A stated default for the tiny Llama (6 x 512, GQA 8:4) on 2 shared CPU cores, fp32.

    Per step: ~12 ms fixed (Python + 6 layers of small ops), 0.25 ms per prefill token, 0.6 ms per
    decoding sequence, 0.2 us per KV token read, 2 ns per prefill attention unit; copying one KV block of
    16 tokens (6 layers, K and V: 192 KiB) 50 us each way between device and host memory. Replace it with
    ``batchpilot.models.llm.profile.profile_llm_steps`` for this machine.
    """
    return CostModel(
        feature_names=LLM_FEATURES,
        latency_coef=(0.012, 2.5e-4, 6.0e-4, 2.0e-7, 2.0e-9, 0.0),
        memory_coef=(0.0,) * 6,
        rel_residuals=(-0.1, 0.0, 0.1, 0.3),
        meta={"source": "default_llm_cost_model", "swap_out_s_per_block": 5e-5, "swap_in_s_per_block": 5e-5},
    )


def sim_preemption_costs(cost_model: CostModel, block_size: int | None = None) -> PreemptionCosts:
    """The model's ``PreemptionCosts``; copy figures a profile lacks are ``default_llm_cost_model``'s
    (for 16-token blocks). ``block_size``: the simulated pool's; a copy's time is scaled from the
    block size it was measured at (the profile's ``block_size``) to it, as a copy is linear in bytes."""
    default = default_llm_cost_model().meta
    out, back = (cost_model.meta.get(k, default[k]) for k in SWAP_META_KEYS)
    measured_at = int(cost_model.meta.get("block_size", 16)) if SWAP_META_KEYS[0] in cost_model.meta else 16
    scale = (block_size or measured_at) / measured_at
    return PreemptionCosts.from_cost_model(cost_model, float(out) * scale, float(back) * scale)


class LLMTarget:
    """``SimTarget`` driving an ``LLMScheduler``. Sequence id = workload row index."""

    def __init__(self, scheduler: LLMScheduler, workload: Workload, cost_model: CostModel,
                 noise: bool = False, seed: int = 0, preemption_costs: PreemptionCosts | None = None,
                 frontend: LLMFrontEnd | None = None) -> None:
        if not {"const", "decode_seqs"} <= set(cost_model.feature_names) <= set(LLM_FEATURES):
            raise ValueError(f"LLM target: the cost model has features {cost_model.feature_names}, an LLM "
                             f"step model needs {LLM_FEATURES}; profile the LLM (not the encoder)")
        self.scheduler = scheduler
        self.admission = LLMAdmission(scheduler.config)
        self.workload = workload
        self.cost_model = cost_model
        self.pricer = StepPricer(cost_model)
        self.preemption_costs = preemption_costs or sim_preemption_costs(cost_model,
                                                                         scheduler.config.block_size)
        self.noise = noise
        self.frontend = frontend or LLMFrontEnd()
        self._rng = np.random.default_rng(seed)
        self.record = LLMRecord(len(workload))
        self._inputs = workload.input_tokens.tolist()
        self._outputs = workload.output_tokens.tolist()
        self._prio = workload.priority.tolist()
        self._busy = False

    @property
    def has_pending(self) -> bool:
        return self.scheduler.has_unfinished()

    def on_arrival(self, index: int, now: float) -> None:
        n_in = max(1, int(self._inputs[index]))
        n_out = max(1, int(self._outputs[index]))
        base = 3 + (index * 7919) % 4000
        params = SamplingParams(max_tokens=n_out, ignore_eos=True)
        seq = Sequence(index, [base + i for i in range(n_in)], params, arrival=now,
                       priority=int(self._prio[index]), deadline=request_deadline(self.scheduler.config, now))
        refusal = self.admission.admit([seq])
        if refusal is not None:
            self._end(index, refusal.reason, now)
        elif self.scheduler.add(seq) is not None:  # unreachable: admission ran the same fit test
            self.admission.release()
            self._end(index, NEVER_FITS, now)

    def _end(self, index: int, reason: str, now: float) -> None:
        self.record.rejected[index] = reason
        self.record.finish_s[index] = now

    def schedule(self, now: float, free_slots: int) -> tuple[list[Job], float | None]:
        if free_slots == 0:
            return [], None
        for seq in self.scheduler.expire(now):  # before each step, as the engine thread
            self.admission.release()
            self._end(seq.seq_id, TIMEOUT, now)
        if not self.scheduler.has_unfinished():
            return [], None
        plan = self.scheduler.schedule(now)  # the same clock as the arrivals: priorities age as live
        if plan.is_empty:
            return [], None
        shape = plan.shape
        predicted = (self.pricer.sample_latency(shape, float(self._rng.random())) if self.noise
                     else self.pricer.latency(shape))
        duration = self.frontend.step_seconds(predicted, len(plan.chunks), shape.prefill_tokens > 0)
        duration += self.preemption_costs.swap_s(len(plan.swap_out), len(plan.swap_in))
        rec = self.record
        rec.step_start.append(now)
        rec.step_duration.append(duration)
        rec.step_tokens.append(plan.num_batched_tokens)
        rec.step_seqs.append(len(plan.chunks))
        return [Job(max(duration, 1e-9), plan)], None

    def on_job_done(self, job: Job, now: float) -> None:
        plan: StepPlan = job.payload
        sampled = {c.seq_id: 10 for c in plan.chunks if c.sample}
        rec = self.record
        for out in self.scheduler.update(plan, sampled):
            i = out.seq_id
            if rec.num_output[i] == 0:
                rec.first_token_s[i] = now
            rec.num_output[i] += 1
            if out.finish_reason is not None:
                rec.finish_s[i] = now
                self.admission.release()


@dataclass
class LLMSimRun:
    workload: Workload
    config: LLMSchedulerConfig
    cost_model: CostModel
    stats: EngineStats
    record: LLMRecord
    num_preemptions: int
    preemption: PreemptionCounters = field(default_factory=PreemptionCounters)
    preemption_costs: PreemptionCosts | None = None

    def report(self, warmup_s: float = 0.0) -> LLMSimReport:
        return summarize_llm(self.record, self.workload.arrival_s, self.num_preemptions, self.preemption,
                             warmup_s)


def simulate_llm(workload: Workload, config: LLMSchedulerConfig | None = None,
                 cost_model: CostModel | None = None, *, noise: bool = False, seed: int = 0,
                 frontend: LLMFrontEnd | None = None,
                 preemption_costs: PreemptionCosts | None = None) -> LLMSimRun:
    """Replay ``workload`` (prompt = input_tokens, output = output_tokens) through a fresh LLMScheduler.
    ``frontend``: the serving path around the engine (the profile's ``frontend`` entry,
    ``sim.llm_frontend``): each step takes ``frontend.step_seconds`` of its predicted time, and
    ``first_token_delay_s`` is added to every token's time as the client sees it.
    ``preemption_costs``: what the scheduler weighs swap against recompute with and a step's copies cost
    (default: ``sim_preemption_costs(cost_model)``)."""
    config = config or LLMSchedulerConfig()
    cost_model = cost_model or default_llm_cost_model()
    costs = preemption_costs or sim_preemption_costs(cost_model, config.block_size)
    scheduler = LLMScheduler(config, costs)
    target = LLMTarget(scheduler, workload, cost_model, noise, seed, costs, frontend)
    stats = Engine(target, num_slots=1).run(workload.arrival_s)  # type: ignore[arg-type]
    delay = frontend.first_token_delay_s if frontend is not None else 0.0
    if delay:
        rec = target.record
        rec.first_token_s = [t + delay for t in rec.first_token_s]
        rec.finish_s = [t + delay for t in rec.finish_s]
    return LLMSimRun(workload, config, cost_model, stats, target.record, scheduler.num_preemptions,
                     scheduler.preemption, costs)


def simulate_cli(args: Any, workload: Workload, console: Any,
                 config: LLMSchedulerConfig | None = None) -> int:
    """``batchpilot simulate --target llm``: ``config`` is the config file's ``llm:`` section."""
    from rich.table import Table

    config = config or LLMSchedulerConfig()
    frontend = None
    if getattr(args, "profile", None):
        cost_model = CostModel.load(args.profile)
        frontend = LLMFrontEnd.from_profile(args.profile)  # the serving path, when the profile has it
    else:
        console.print("[yellow]no --profile: using the stated default_llm_cost_model() (tiny Llama on 2 CPU "
                      "cores)[/]")
        cost_model = default_llm_cost_model()
    try:
        run = simulate_llm(workload, config, cost_model, noise=bool(getattr(args, "noise", False)),
                           seed=int(getattr(args, "seed", 0)), frontend=frontend)
    except ValueError as exc:
        console.print(f"[red]batchpilot simulate: {exc}[/]")
        return 2
    report = run.report(warmup_s=float(getattr(args, "warmup_s", 0.0)))
    table = Table(title=f"{workload.name}: {len(workload)} requests (LLM, iteration-level scheduling)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in report.rows():
        table.add_row(k, v)
    console.print(table)
    if run.stats.stalled:
        console.print("[red]the scheduler left requests unfinished with nothing scheduled (stalled)[/]")
        return 1
    return 0
