"""What an LLM simulation recorded and what it reports: ``LLMRecord`` (per request and per step, filled
by ``sim.llm.LLMTarget``) and ``summarize_llm`` -> ``LLMSimReport``.

A request is *finished* when it produced its tokens and was neither refused nor expired; one that was
(``LLMRecord.rejected`` holds the server's error code: ``context_length_exceeded``, ``queue_full``,
``timeout``) counts in ``num_rejected`` and ``rejected_by_reason`` only, also when it had streamed some
tokens before its deadline: the live load generator counts its error event as a failed request.
TTFT, TPOT, end-to-end latency and output tokens/s are over the finished requests.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from batchpilot.core.preemption import PreemptionCounters


@dataclass
class LLMRecord:
    """Per request: arrival, first token, finish (NaN until then), tokens out, why it was refused or
    expired (the server's error code; None: served); per step: shape and time."""

    n: int
    first_token_s: list[float] = field(default_factory=list)
    finish_s: list[float] = field(default_factory=list)
    num_output: list[int] = field(default_factory=list)
    rejected: list[str | None] = field(default_factory=list)
    step_start: list[float] = field(default_factory=list)
    step_duration: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_seqs: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.first_token_s = [math.nan] * self.n
        self.finish_s = [math.nan] * self.n
        self.num_output = [0] * self.n
        self.rejected = [None] * self.n


@dataclass
class LLMSimReport:
    num_requests: int
    num_finished: int
    num_rejected: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    e2e_p50: float
    e2e_p99: float
    num_preemptions: int
    num_steps: int
    mean_step_tokens: float
    mean_step_s: float = math.nan
    mean_step_seqs: float = math.nan
    num_swapped_out: int = 0  # preemptions that swapped (the rest of num_preemptions recomputed)
    num_recomputed_tokens: int = 0  # computed tokens recompute preemptions threw away
    rejected_by_reason: dict[str, int] = field(default_factory=dict)  # refused and expired, by error code

    def rows(self) -> list[tuple[str, str]]:
        ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.rejected_by_reason.items()))
        return [
            ("requests (finished / rejected)",
             f"{self.num_finished} / {self.num_rejected} of {self.num_requests}{f' ({why})' if why else ''}"),
            ("output tokens/s", f"{self.output_tokens_per_s:.1f}"),
            ("TTFT p50 / p99", f"{ms(self.ttft_p50)} / {ms(self.ttft_p99)}"),
            ("TPOT p50 / p99", f"{ms(self.tpot_p50)} / {ms(self.tpot_p99)}"),
            ("end-to-end p50 / p99", f"{self.e2e_p50:.2f} s / {self.e2e_p99:.2f} s"),
            ("steps (mean tokens per step)", f"{self.num_steps} ({self.mean_step_tokens:.1f})"),
            ("preemptions (swapped / recomputed)", f"{self.num_preemptions} ({self.num_swapped_out} / "
                                                   f"{self.num_preemptions - self.num_swapped_out})"),
            ("recomputed tokens", str(self.num_recomputed_tokens)),
        ]


def summarize_llm(record: LLMRecord, arrival_s: np.ndarray, num_preemptions: int,
                  preemption: PreemptionCounters, warmup_s: float = 0.0) -> LLMSimReport:
    """The report of a run: requests arriving before ``warmup_s`` are left out of the latencies."""
    rec, arr = record, np.asarray(arrival_s)
    first, fin = np.asarray(rec.first_token_s), np.asarray(rec.finish_s)
    nout = np.asarray(rec.num_output)
    served = np.asarray([r is None for r in rec.rejected], dtype=bool)
    done = ~np.isnan(fin) & (nout > 0) & served & (arr >= warmup_s)
    ttft = (first - arr)[done]
    multi = done & (nout > 1)
    tpot = ((fin - first)[multi] / (nout[multi] - 1))
    e2e = (fin - arr)[done]

    def q(x: np.ndarray, p: float) -> float:
        return float(np.percentile(x, p)) if x.size else math.nan

    span = float(np.nanmax(fin) - arr[0]) if done.any() else 0.0
    return LLMSimReport(
        num_requests=len(arr), num_finished=int(done.sum()),
        num_rejected=sum(r is not None for r in rec.rejected), duration_s=span,
        rejected_by_reason=dict(Counter(r for r in rec.rejected if r is not None)),
        output_tokens_per_s=float(nout[done].sum() / span) if span > 0 else 0.0,
        ttft_p50=q(ttft, 50), ttft_p99=q(ttft, 99), tpot_p50=q(tpot, 50), tpot_p99=q(tpot, 99),
        e2e_p50=q(e2e, 50), e2e_p99=q(e2e, 99), num_preemptions=num_preemptions,
        num_steps=len(rec.step_start),
        mean_step_tokens=float(np.mean(rec.step_tokens)) if rec.step_tokens else 0.0,
        mean_step_s=float(np.mean(rec.step_duration)) if rec.step_duration else math.nan,
        mean_step_seqs=float(np.mean(rec.step_seqs)) if rec.step_seqs else math.nan,
        num_swapped_out=preemption.num_swapped_out,
        num_recomputed_tokens=preemption.num_recomputed_tokens,
    )
