"""What a grammar costs an LLM step: decode steps with a share of the sequences under a JSON schema.

    decode_step_seconds(engine, seqs, share, steps)   the mean time of a decode step of ``seqs``
                                                      sequences, ``share`` of them under ``SCHEMA``
    measure_structured_cost(engine)                   seconds one structured sequence adds to a step:
                                                      all under the schema against none, interleaved

A step here is what the engine thread does for it: the runner's forward, the sampler's choice (masks
filled and applied, matchers advanced) and the scheduler's update, on the engine's own runner and
sampler (an engine built, not started: nothing else runs on them). ``batchpilot profile --llm`` stores
the cost as the service model's ``structured_s_per_seq``, what ``simulate --target llm
--structured-share`` prices each structured sequence's step with (``sim/llm.py``).

The schema keeps an answer open for the whole measurement (an array of at least 16 objects, each with
a bounded string, an enum, a number and a nested array), so no matcher terminates and every step masks.
"""

from __future__ import annotations

import json
import time
from typing import Any

from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.core.llm.sequence import SamplingParams, Sequence, StructuredOutput

SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 16, "items": {
        "type": "object", "additionalProperties": False,
        "required": ["id", "name", "kind", "score", "tags"],
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                       "kind": {"enum": ["a", "b", "c"]}, "score": {"type": "number"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                "maxItems": 4}}}}
CONSTRAINT = StructuredOutput("json_schema", json.dumps(SCHEMA))
PROMPT_TOKENS = 16


def decode_step_seconds(engine: Any, seqs: int, share: float, steps: int = 16, seed: int = 0) -> float:
    """The mean seconds of ``steps`` decode steps of ``seqs`` sequences, ``round(share * seqs)`` of them
    under ``SCHEMA`` (temperature 1, seeded), after their prefill."""
    runner, sampler = engine.runner, engine.sampler
    sched = LLMScheduler(engine.config)
    structured = round(share * seqs)
    for i in range(seqs):
        params = SamplingParams(max_tokens=steps + 2, temperature=1.0, seed=seed + i, ignore_eos=True,
                                structured=CONSTRAINT if i < structured else None)
        prompt = [3 + (seed * 131 + i * 17 + t) % 3000 for t in range(PROMPT_TOKENS)]
        if sched.add(Sequence(i, prompt, params)) is not None:
            raise ValueError(f"the engine's KV pool cannot hold {seqs} sequences of {PROMPT_TOKENS + steps} "
                             "tokens")
    times: list[float] = []
    while sched.has_unfinished():
        plan = sched.schedule()
        t0 = time.perf_counter()
        batch = [sched.seqs[c.seq_id] for c in plan.chunks if c.sample]
        choices = sampler.choose(runner.forward(plan.chunks), batch)
        sched.update(plan, {s.seq_id: c.token for s, c in zip(batch, choices, strict=True)})
        if plan.shape.prefill_tokens == 0 and len(plan.chunks) == seqs:
            times.append(time.perf_counter() - t0)
    for i in range(seqs):
        sampler.forget(i)
    return sum(times[1:]) / max(len(times) - 1, 1)  # the first decode step warms the masks' caches


def measure_structured_cost(engine: Any, seqs: int = 16, steps: int = 16, rounds: int = 3
                            ) -> tuple[float, dict[str, Any]]:
    """Seconds one sampled sequence under a schema adds to a step (>= 0), and what was measured."""
    plain, under = [], []
    for r in range(rounds):  # interleaved: the machine's drift falls on both
        plain.append(decode_step_seconds(engine, seqs, 0.0, steps, seed=r))
        under.append(decode_step_seconds(engine, seqs, 1.0, steps, seed=r))
    p, u = sorted(plain)[rounds // 2], sorted(under)[rounds // 2]
    per_seq = max(0.0, (u - p) / seqs)
    return per_seq, {"seqs": seqs, "steps": steps, "rounds": rounds, "plain_step_s": p,
                     "structured_step_s": u, "structured_s_per_seq": per_seq}
