"""The precision an LLM engine runs at, chosen on this machine by measurement under a guard.

    choose_llm_precision(weights, requested, device, kv_dtype=None, guard=LLMGuard()) -> LLMPrecisionReport

A precision here is the weights' and the activations' dtype, and (unless ``kv_dtype`` names another) the
KV cache's. The candidates are the encoder's (``models.precision.candidates``): float32 always, the
reference; bfloat16 on a CPU with AVX512-BF16 or AMX, or a CUDA device with bf16; float16 on CUDA.

* ``auto``: every candidate is checked by the guard and timed on the probe steps; the fastest that passes
  is served, float32 when none is faster (the log says each one's figures).
* a named precision: checked by the guard, not timed; one that fails it is an error that says what was
  measured (nothing else is served silently in its place).
* ``float32``: the reference itself, no probe.

**The guard.** A fixed probe: ``PROBE_PROMPTS`` seeded token-id prompts (3 to 200 tokens) prefilled in one
step, then ``PROBE_STEPS`` decode steps in which every sequence is fed float32's own greedy token (teacher
forcing: a flip on a near tie does not send the rest of the comparison down another path). It runs on a
probe runner per precision with a small KV pool, through the same forward as serving (decode runs,
the cache written and read at the candidate's KV dtype). A candidate passes when

* greedy agreement: its argmax equals float32's at no fewer than ``min_agreement`` of the probe's
  positions (a random or weakly trained model has near-tied logits, and any rounding flips some), and
* logit tolerance: at every position, the largest ``|logit - float32 logit|`` is at most
  ``max_logit_error`` times the spread (standard deviation) of float32's logits there.

**The timing**: the probe steps of ``TIMED_STEPS`` (a lone decode, 16 and 64 decodes, a 256-token
prefill; block tables wrap around the probe pool) with each candidate's dense matrices packed where
that pays (``dense.packing_pays``, measured per candidate), the median of ``repeats`` runs after a
warm-up; each repeat times the candidates in turn, each in a block of its own after one untimed step
(the other candidate's weights have left the caches); a candidate's figure is the sum over the steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from batchpilot.core.deployment import LLM_PRECISIONS
from batchpilot.core.llm.scheduler import ScheduledChunk
from batchpilot.models.llm.dense import PackingReport, packing_pays
from batchpilot.models.llm.runner import LLMModelRunner, step_plan
from batchpilot.models.llm.weights import LayerWeights, LlamaWeights
from batchpilot.models.precision import candidates

KV_PRECISIONS = LLM_PRECISIONS[1:]
PROBE_PROMPTS = (3, 17, 64, 200)  # prompt lengths of the guard's probe
PROBE_STEPS = 24  # teacher-forced decode steps after the prefill
PROBE_SEED = 11
PROBE_BLOCKS = 256  # the probe runners' KV pool, in blocks of BLOCK_SIZE
BLOCK_SIZE = 16
TIMED_STEPS = ((0, 1, 256), (0, 16, 256), (0, 64, 256), (256, 0, 0))  # (prefill tokens, decodes, context)


@dataclass(frozen=True)
class LLMGuard:
    """How close to float32 a precision must stay on the probe (module docstring)."""

    min_agreement: float = 0.9
    max_logit_error: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 < self.min_agreement <= 1.0:
            raise ValueError(f"llm precision guard: min_agreement must be in (0, 1], "
                             f"got {self.min_agreement}")
        if not self.max_logit_error > 0.0:
            raise ValueError(f"llm precision guard: max_logit_error must be > 0, got {self.max_logit_error}")


@dataclass
class LLMPrecisionReport:
    """What ``choose_llm_precision`` measured and chose. ``measured[dtype]``: ``ms`` (the timed probe
    steps; NaN when not timed), ``agreement``, ``logit_error`` (worst over positions, in float32 logit
    spreads), ``passed`` (1/0); ``packing[dtype]``: what ``packing_pays`` found for it."""

    requested: str
    chosen: str
    kv_dtype: str
    guard: LLMGuard
    measured: dict[str, dict[str, float]] = field(default_factory=dict)
    packing: dict[str, PackingReport] = field(default_factory=dict)
    reason: str = ""

    @property
    def label(self) -> str:
        """The precision served: ``bfloat16``, or ``float32/kv bfloat16`` where the KV cache's differs."""
        return _label(self.chosen, self.kv_dtype)

    @property
    def packing_report(self) -> PackingReport | None:
        """What packing the chosen precision's matrices measured (None: not measured here)."""
        return self.packing.get(self.label)

    def describe(self) -> str:
        rows = []
        for d, m in self.measured.items():
            ms = f"{m['ms']:.1f} ms, " if m["ms"] == m["ms"] else ""
            verdict = "" if m["passed"] else " (failed the guard)"
            rows.append(f"{d}: {ms}greedy agreement {m['agreement']:.3f}, logit error {m['logit_error']:.3f}"
                        f"{verdict}")
        packing = self.packing_report
        packed = f"; {packing.describe()}" if packing is not None else ""
        return f"dtype {self.label} ({self.reason}); measured {'; '.join(rows) or 'nothing'}{packed}"


def cast_weights(weights: LlamaWeights, dtype: torch.dtype) -> LlamaWeights:
    """A copy of ``weights`` whose tensors are ``dtype`` (the same tensors where they already are): the
    runner casts the weights it is given in place, so each probe runner gets its own."""
    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    layers = [dataclasses.replace(layer, **{n: cast(getattr(layer, n)) for n in LayerWeights.TENSORS})
              for layer in weights.layers]
    tied = weights.lm_head.data_ptr() == weights.embed.data_ptr()
    embed = weights.embed.to(dtype)
    return dataclasses.replace(weights, embed=embed, layers=layers, norm=weights.norm.to(dtype),
                               lm_head=embed if tied else weights.lm_head.to(dtype))


def probe_prompts(vocab_size: int, lengths: Sequence[int] = PROBE_PROMPTS, seed: int = PROBE_SEED
                  ) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    low = min(7, vocab_size - 1)
    return [torch.randint(low, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _tables(prompts: Sequence[list[int]], steps: int, block_size: int) -> list[list[int]]:
    tables, nxt = [], 0
    for p in prompts:
        n = -(-(len(p) + steps) // block_size)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    return tables


@torch.inference_mode()
def teacher_forced_logits(runner: LLMModelRunner, prompts: Sequence[list[int]], steps: int,
                          forced: list[list[int]] | None = None) -> tuple[torch.Tensor, list[list[int]]]:
    """``[steps + 1, len(prompts), vocab]`` float32 logits: the prefill's, then each decode step's, every
    sequence fed ``forced[i][s]`` at step ``s`` (None: its own argmax, which is returned too)."""
    tables = _tables(prompts, steps, runner.block_size)
    chunks = [ScheduledChunk(i, 0, list(p), t, True, False) for i, (p, t) in enumerate(zip(prompts, tables,
                                                                                           strict=True))]
    out = [runner.forward(chunks)]
    own: list[list[int]] = [[] for _ in prompts]
    for s in range(steps):
        last = out[-1].argmax(-1).tolist()
        for i, tok in enumerate(last):
            own[i].append(tok)
        feed = [f[s] for f in forced] if forced is not None else last
        chunks = [ScheduledChunk(i, len(p) + s, [feed[i]], t, True, True)
                  for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
        out.append(runner.forward(chunks))
    return torch.stack(out), own


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """(greedy agreement, worst logit error in spreads of the reference) of two logit stacks."""
    agree = (reference.argmax(-1) == candidate.argmax(-1)).float().mean().item()
    spread = reference.std(dim=-1).clamp_min(1e-12)
    error = ((candidate - reference).abs().amax(dim=-1) / spread).max().item()
    return float(agree), float(error)


def _time_steps(runners: dict[str, LLMModelRunner], repeats: int) -> dict[str, float]:
    plans = {d: [step_plan(r, [n] if n else [], [ctx] * b) for n, b, ctx in TIMED_STEPS]
             for d, r in runners.items()}
    best: dict[str, list[list[float]]] = {d: [[] for _ in TIMED_STEPS] for d in runners}
    with torch.inference_mode():
        for d, r in runners.items():
            for plan in plans[d]:
                r.forward(plan.chunks).argmax(-1).tolist()  # warm-up
        for _ in range(repeats):
            for d, r in runners.items():  # a block per candidate: its weights back in the caches first
                r.forward(plans[d][0].chunks).argmax(-1).tolist()
                for k, plan in enumerate(plans[d]):
                    t0 = time.perf_counter()
                    r.forward(plan.chunks).argmax(-1).tolist()
                    best[d][k].append(time.perf_counter() - t0)
    return {d: 1e3 * sum(sorted(t)[len(t) // 2] for t in ts) for d, ts in best.items()}


def _label(name: str, kv: str) -> str:
    return name if kv == name else f"{name}/kv {kv}"


def choose_llm_precision(load: Callable[[], LlamaWeights], requested: str, device: torch.device,
                         kv_dtype: str | None = None, guard: LLMGuard | None = None,
                         repeats: int = 3) -> LLMPrecisionReport:
    """What to serve the model ``load()`` gives (float32, called only when there is something to probe)
    at; see the module docstring. ``kv_dtype``: the KV cache's precision for every candidate (None: each
    candidate's own). Raises ``ValueError`` for an unknown precision, or a named one that fails the
    guard."""
    guard = guard or LLMGuard()
    if requested not in LLM_PRECISIONS:
        raise ValueError(f"llm dtype = {requested!r}; choose one of {', '.join(LLM_PRECISIONS)}")
    if kv_dtype is not None and kv_dtype not in KV_PRECISIONS:
        raise ValueError(f"llm kv dtype = {kv_dtype!r}; choose one of {', '.join(KV_PRECISIONS)}")
    if requested == "float32" and kv_dtype in (None, "float32"):
        return LLMPrecisionReport("float32", "float32", "float32", guard,
                                  reason="asked for; the reference, no guard")
    names = candidates(device) if requested == "auto" else [requested]
    tried = [(n, kv_dtype or n) for n in names]
    if ("float32", "float32") not in tried:
        tried.insert(0, ("float32", "float32"))  # the reference, first
    if tried == [("float32", "float32")]:
        return LLMPrecisionReport("auto", "float32", "float32", guard,
                                  reason=f"no faster precision on this {device.type} (no bf16 matrix units)")
    timed = requested == "auto"
    report = LLMPrecisionReport(requested, "float32", "float32", guard)
    weights = load()
    prompts = probe_prompts(weights.vocab_size)
    runners: dict[str, LLMModelRunner] = {}
    reference: torch.Tensor | None = None
    forced: list[list[int]] = []
    for name, kv in tried:
        label, dtype = _label(name, kv), getattr(torch, name)
        runner = LLMModelRunner(cast_weights(weights, dtype), PROBE_BLOCKS, BLOCK_SIZE, device=device,
                                dtype=dtype, kv_dtype=getattr(torch, kv))
        report.packing[label] = packing_pays(runner.w.dense_matrices(), runner.device, dtype)
        runner.pack(report.packing[label].packed)
        if reference is None:  # float32 weights and KV: the reference
            reference, forced = teacher_forced_logits(runner, prompts, PROBE_STEPS)
            agree, error = 1.0, 0.0
        else:
            logits, _ = teacher_forced_logits(runner, prompts, PROBE_STEPS, forced)
            agree, error = compare(reference, logits)
        passed = agree >= guard.min_agreement and error <= guard.max_logit_error
        report.measured[label] = {"ms": float("nan"), "agreement": agree, "logit_error": error,
                                  "passed": float(passed)}
        if passed:
            runners[label] = runner
        elif not timed:
            raise ValueError(f"llm dtype {label}: greedy agreement with float32 {agree:.3f} (the guard asks "
                             f">= {guard.min_agreement}), logit error {error:.3f} spreads (<= "
                             f"{guard.max_logit_error}) on the probe; serve float32")
    if timed:
        for label, ms in _time_steps(runners, repeats).items():
            report.measured[label]["ms"] = ms
        best = min(runners, key=lambda d: report.measured[d]["ms"])
        report.reason = "the fastest that passed the guard"
    else:
        best = _label(requested, kv_dtype or requested)
        m = report.measured[best]
        report.reason = (f"asked for; passed the guard (agreement {m['agreement']:.3f}, logit error "
                         f"{m['logit_error']:.3f})")
    report.chosen, report.kv_dtype = {_label(n, k): (n, k) for n, k in tried}[best]
    return report
