"""``batchpilot profile --llm``: the LLM engine's step cost model and memory, written as one profile file.

The engine is built as ``serve --llm`` builds it (``runtime/llm_build.build_llm_engine``: the same
model, precision and threads), not started. Measured on its runner:

* ``cost_model``: the step time model (``models/llm/profile.profile_llm_steps``), what ``simulate
  --target llm --profile`` prices steps with;
* ``memory``: weights, KV bytes per token, the overhead and the activation peak
  (``runtime/llm_memory.profile_engine_memory``),
  what ``serve --llm --llm-profile`` and ``simulate --target llm --profile`` plan the KV pool from
  (``core/kv_plan.py``);
* ``free_bytes``: the device's free memory before the model loaded, so a ``memory_utilization``
  budget can be planned in the simulator as it would be on this machine;
* the swap copy times (``cost_model.meta``, from ``profile_llm_steps``), what swap preemption is
  priced with in the simulator;
* ``frontend`` and ``serving_path``: the routes' serving path, measured after the steps on a fresh
  engine built the same way (the memory burst stopped the first) and started behind the real app
  (``server/llm_serving_profile.measure_llm_serving_path``: the first-token delay and a step's price
  under the profile's own streamed load), what ``simulate --target llm --profile`` times every step
  with; ``--no-serving-path`` leaves them out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Any


def run_llm(args: argparse.Namespace) -> int:
    import torch

    from batchpilot.core.kv_plan import MIB
    from batchpilot.models.device import free_memory_bytes, resolve_device
    from batchpilot.models.llm.profile import profile_llm_steps
    from batchpilot.runtime.llm_build import build_llm_engine
    from batchpilot.runtime.llm_memory import profile_engine_memory

    device = resolve_device(args.device)
    dtype = "float32" if args.dtype in ("auto", "float32") else args.dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        print(f"batchpilot profile --llm: --dtype {dtype} is not an LLM precision; use float32, bfloat16 or "
              f"float16")
        return 2
    free = free_memory_bytes(device)
    t0 = time.perf_counter()
    engine = build_llm_engine(args.model, device=str(device), dtype=dtype, threads=args.threads or 0,
                              num_swap_blocks=16, start=False)  # host blocks: the swap copies get timed
    runner = engine.runner
    print(f"{engine.model_name} on {device} ({dtype}, {torch.get_num_threads()} threads), loaded in "
          f"{time.perf_counter() - t0:.1f} s; KV pool {runner.num_kv_blocks} blocks x {runner.block_size}")
    t1 = time.perf_counter()
    memory, mem_points = profile_engine_memory(engine)
    print(f"memory: weights {memory.weights_bytes / MIB:.1f} MiB, overhead "
          f"{memory.overhead_bytes / MIB:.1f} MiB, KV {memory.kv_bytes_per_token} B per "
          f"token, activation {memory.activation_fixed_bytes / MIB:.2f} MiB + "
          f"{memory.activation_bytes_per_token:.0f} B per batched token + "
          f"{memory.activation_bytes_per_read_token:.0f} B per gathered context token "
          f"({len(mem_points)} steps measured)")
    model = profile_llm_steps(runner, repeats=args.repeats)
    coef = ", ".join(f"{n}={c:.3g}" for n, c in zip(model.feature_names, model.latency_coef, strict=True))
    print(f"step model: {coef}  (seconds per feature unit)")
    model.meta.update(device=str(device), dtype=dtype, model=engine.model_name, model_path=args.model,
                      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    doc: dict[str, Any] = {
        "kind": "llm",
        "cost_model": model.to_dict(),
        "memory": memory.to_dict(),
        "memory_points": mem_points,
        "free_bytes": free,
        "model_max_len": int(runner.cos.shape[0]),  # the model's positions: max_model_len when not given
        "device": device.type,
        "meta": {"model": engine.model_name, "device": str(device), "dtype": dtype,
                 "threads": torch.get_num_threads(), "torch": torch.__version__,
                 "seconds": time.perf_counter() - t1},
    }
    if not args.no_serving_path:
        del engine, runner  # the memory burst shut that engine down: the serving path gets a fresh one
        fresh = build_llm_engine(args.model, device=str(device), dtype=dtype, threads=args.threads or 0,
                                 start=False)
        doc["frontend"], doc["serving_path"] = serving_path(fresh, model)
    Path(args.output).write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.output} in {time.perf_counter() - t1:.1f} s")
    return 0



def serving_path(engine: Any, cost_model: Any, **measure: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start ``engine`` (built, never started), measure its serving path through the real app and shut
    it down; returns the ``frontend`` entry and what was measured (``serving_path``). ``measure``:
    keyword arguments of ``measure_llm_serving_path`` (``loaded_requests``, ...)."""
    from batchpilot.server.llm_serving_profile import measure_llm_serving_path

    t0 = time.perf_counter()
    engine.start()
    try:
        frontend, details = measure_llm_serving_path(engine, cost_model, **measure)
    finally:
        engine.shutdown()
    print(f"serving path: first token {frontend.first_token_delay_s * 1e3:.2f} ms after the engine's "
          f"({details['first_token']['ok']} lone streams); under load a step takes "
          f"{frontend.step_alpha:.3f} x the step model + {frontend.step_const_s * 1e3:.2f} ms + "
          f"{frontend.step_per_seq_s * 1e3:.3f} ms per sequence ({details['loaded'].get('steps', 0)} "
          f"steps) in {time.perf_counter() - t0:.1f} s; the forward by sequences per step: "
          + ", ".join(f"x{f:.3f} from {lo}" for lo, f in frontend.step_seq_factors))
    return frontend.to_dict(), details
