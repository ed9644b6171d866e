"""``batchpilot profile``: measure an encoder over a grid of batch shapes (``models/profiler.py``),
fit the cost model, measure the serving path, and write the profile JSON.

Unless ``--no-serving-path``, the serving path around the batcher: the real app served in-process,
requests sent one at a time (``profile/serving.py``), fitted into the simulator's
``sim.service.ServiceModel`` and written under the profile's ``"service"`` key.

The precision profiled is chosen as ``serve`` chooses it (``models/precision.py``) and recorded in the
cost model's meta (``dtype``, ``backend``). ``--all-backends`` profiles every backend and precision
that passes the accuracy guard on this machine, one file each (``p.json`` -> ``p.torch-float32.json``,
``p.torch-bfloat16.json``, ``p.onnx-float32.json``...): ``batchpilot tune --profile-variants`` searches
across them.

``--recheck p.json -o now.json`` profiles nothing: it times p.json's own smaller batches again and
writes p.json at this machine's speed now (``profile/speed_check.py``), in seconds.

torch is imported lazily: ``batchpilot --help`` must work without it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from batchpilot.core.costmodel import CostModel
from batchpilot.core.deployment import BACKENDS, ModelOptions
from batchpilot.core.deployment import PRECISIONS as PRECISION_CHOICES
from batchpilot.models.profiler import (
    STANDARD_BATCH_SIZES,
    STANDARD_LENGTHS,
    Measurement,
    leave_one_out,
    measure,
    profile_grid,
)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="measure an encoder over batch shapes and fit the cost model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="local HF encoder folder (default: the embedded all-MiniLM-L6-v2)")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile JSON")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(STANDARD_BATCH_SIZES))
    p.add_argument("--lengths", type=int, nargs="+", default=list(STANDARD_LENGTHS), help="tokens per input")
    p.add_argument("--padding", choices=("dynamic", "none"), default="dynamic",
                   help="padded (uniform lengths: dynamic = max = bucket) or padding-free execution")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per shape (median), after one warm-up")
    p.add_argument("--holdout", type=int, default=4,
                   help="extra seeded mixed-length batches, measured and predicted to report the error")
    p.add_argument("--budget-s", type=float, default=None, help="stop adding shapes past this many seconds")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory run of each shape")
    p.add_argument("--max-batch-tokens", type=int, default=4096,
                   help="leave out shapes with more than n x L tokens (0 = keep all)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", choices=PRECISION_CHOICES, default="auto",
                   help="precision to profile (auto: the fastest this machine supports that passes the "
                        "accuracy guard, measured here; `serve --profile` then serves the same one)")
    p.add_argument("--min-cosine", type=float, default=ModelOptions.min_cosine,
                   help="accuracy guard: least cosine to float32 embeddings on the probe set")
    p.add_argument("--backend", choices=BACKENDS, default="torch",
                   help="torch, or onnx (ONNX Runtime; its export is cached beside the output profile)")
    p.add_argument("--all-backends", action="store_true",
                   help="profile every backend and precision that passes the guard, one file each "
                        "(-o p.json -> p.torch-float32.json, ...), for `batchpilot tune --profile-variants`")
    p.add_argument("--llm", action="store_true",
                   help="profile the LLM engine instead (--model: a local HF causal-LM folder, default the "
                        "seeded tiny Llama): its step cost model and memory (profile/llm.py)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads, fixed (default: a thread plan per batch size, measured first and "
                   "stored in the profile; models/encoder.py)")
    p.add_argument("--max-length", type=int, default=None, help="serve up to this many tokens (default: "
                   "the model's position limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-serving-path", action="store_true",
                   help="skip the serving-path measurement (the profile's 'service' entry)")
    p.add_argument("--serving-requests", type=int, default=24,
                   help="serving path: input lengths from 4 tokens to the model's limit, each sent twice")
    p.add_argument("--loaded-requests", type=int, default=None,
                   help="serving path: open-loop requests that measure a batch's time under serving load "
                        "(default: profile.serving.LOADED_REQUESTS, 1080; 0 = not measured)")
    p.add_argument("--recheck", default=None, metavar="PROFILE",
                   help="instead of profiling: time PROFILE's smaller grid batches again (seconds, --repeats "
                        "calls each) and write it to --output at this machine's speed now "
                        "(profile/speed_check.py)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.recheck:
        from batchpilot.profile.speed_check import recheck

        try:
            recheck(args.recheck, args.output, args.repeats, args.seed)
        except (OSError, ValueError, KeyError) as exc:
            print(f"profile --recheck: {exc}")
            return 2
        return 0
    if args.llm:
        from batchpilot.profile.llm import run_llm

        return run_llm(args)
    if not args.all_backends:
        return profile_one(args, args.backend, args.dtype, args.output)
    from batchpilot.models.device import resolve_device

    written = []
    for backend, dtype in variants(resolve_device(args.device)):
        out = variant_path(args.output, backend, dtype)
        try:
            profile_one(args, backend, dtype, out)
        except (ValueError, ImportError) as exc:  # the guard refused it, or the backend is not installed
            print(f"{backend}/{dtype}: not profiled: {exc}")
            continue
        written.append(out)
    print(f"\nwrote {len(written)} profiles; `batchpilot tune --profile-variants {' '.join(written)}` "
          "searches across them")
    return 0 if written else 1


def variants(device: Any) -> list[tuple[str, str]]:
    """Every (backend, precision) worth profiling here: torch at each candidate precision and int8,
    onnx at float32 and int8 (where onnxruntime is installed and the device is the CPU)."""
    from batchpilot.models.precision import candidates

    out = [("torch", d) for d in candidates(device)] + ([("torch", "int8")] if device.type == "cpu" else [])
    return out + ([("onnx", "float32"), ("onnx", "int8")] if device.type == "cpu" else [])


def variant_path(output: str, backend: str, dtype: str) -> str:
    p = Path(output)
    return str(p.with_name(f"{p.stem}.{backend}-{dtype}{p.suffix or '.json'}"))


def profile_one(args: argparse.Namespace, backend: str, dtype: str, output: str) -> int:
    from rich.console import Console

    from batchpilot.models.device import resolve_device
    from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, plan_for
    from batchpilot.models.precision import choose_precision

    console = Console(stderr=True)
    t0 = time.perf_counter()

    def load(d: str) -> EncoderExecutor:
        cfg = EncoderConfig(model_path=args.model, device=args.device, dtype=d,  # type: ignore[arg-type]
                            num_threads=args.threads, max_length=args.max_length)
        if backend == "onnx":
            from batchpilot.models.onnx_encoder import OnnxEncoderExecutor

            return OnnxEncoderExecutor(cfg, Path(output).resolve().parent)
        return EncoderExecutor(cfg)

    device = resolve_device("cpu" if backend == "onnx" else args.device)
    ex, precision = choose_precision(load, dtype, device, args.min_cosine, backend)
    ex.warmup()
    ex.threads = plan_for(ex, args.threads)
    console.print(f"{ex.model_name} on {ex.device} ({ex.forward_impl} forward, {ex.threads.describe()}), "
                  f"padding {args.padding}, loaded in {time.perf_counter() - t0:.1f} s; "
                  f"precision: {precision.describe()}")
    t1 = time.perf_counter()
    model, points = profile_grid(ex, tuple(args.batch_sizes), tuple(args.lengths), args.repeats,
                                 args.budget_s, args.padding, not args.no_memory, True, args.seed,
                                 args.max_batch_tokens or None)
    loo = leave_one_out([m.point() for m in points]) if len(points) > len(model.feature_names) else []
    rng = random.Random(args.seed + 1)
    held: list[tuple[Measurement, float]] = []
    top = min(max(args.lengths), ex.max_length)
    for _ in range(args.holdout):
        lens = [rng.randint(min(8, top), top) for _ in range(rng.randint(1, max(args.batch_sizes)))]
        m = measure(ex, lens, args.padding, args.repeats, rng, memory=False)
        held.append((m, model.latency(m.features) / m.latency_s - 1.0))
    wall = time.perf_counter() - t1

    Console().print(_table(ex.model_name, args.padding, model, points, loo, held))
    coef = ", ".join(f"{n}={c:.3g}" for n, c in zip(model.feature_names, model.latency_coef, strict=True))
    print(f"latency model: {coef}  (seconds per feature unit)")
    summary = _error_summary(loo, [e for _, e in held])
    print("prediction error: " + ", ".join(f"{k} {v:.1%}" for k, v in summary.items()))
    meta = _meta(ex, args, wall, summary)
    model.meta.update({k: meta[k] for k in ("model", "device", "torch", "threads", "thread_plan", "date")})
    model.meta.update(dtype=precision.chosen, precision_min_cosine=precision.min_cosine, backend=backend)
    meta["precision"] = {"requested": precision.requested, "chosen": precision.chosen,
                         "min_cosine": precision.min_cosine, "threshold": precision.threshold,
                         "measured": precision.measured, "reason": precision.reason}
    doc = {
        "cost_model": model.to_dict(),
        "points": [m.to_dict() for m in points],
        "holdout": [dict(m.to_dict(), predicted_s=model.latency(m.features)) for m, _ in held],
        "meta": meta,
    }
    if not args.no_serving_path:
        serving = _serving_path(ex, model, args, console)
        if serving is not None:
            doc["service"], doc["serving_path"] = serving
    Path(output).write_text(json.dumps(doc, indent=2))
    print(f"wrote {output} ({len(points)} shapes + {len(held)} held-out batches in {wall:.1f} s)")
    return 0


def _serving_path(ex: Any, model: CostModel, args: argparse.Namespace,
                  console: Any) -> tuple[dict[str, float], dict[str, Any]] | None:
    """The serving-path measurement (``profile/serving.py``) as the profile's ``service`` and
    ``serving_path`` entries; None, with a warning, when the server stack is missing or it failed (the
    cost model is still written)."""
    try:
        from batchpilot.profile.serving import measure_serving_path
    except ImportError as exc:
        console.print(f"[yellow]warning:[/] serving path not measured: the server stack is not importable "
                      f"({exc}); the profile has no 'service' entry")
        return None
    try:
        loaded = {} if args.loaded_requests is None else {"loaded_requests": args.loaded_requests}
        service, details = measure_serving_path(ex, model, requests=args.serving_requests, seed=args.seed,
                                                padding=args.padding, **loaded)
    except (RuntimeError, ValueError, OSError) as exc:
        console.print(f"[yellow]warning:[/] serving path not measured: {exc}; the profile has no "
                      "'service' entry")
        return None
    req, batch = service.request, service.batch
    print(f"serving path ({details['ok']} lone requests, {details['min_tokens']}-{details['max_tokens']} "
          f"tokens, {details['wall_s']:.1f} s): outside the batcher {req.delay_const_s * 1e3:.2f} ms + "
          f"{req.delay_per_token_s * 1e6:.2f} us/token, driver overhead {batch.overhead_s * 1e3:.2f} ms a "
          "batch; "
          f"under load a batch takes the cost model x {batch.alpha:.3f} + {batch.const_s * 1e3:.2f} ms"
          + "".join(f", x{f:.2f} from {lo} tokens" for lo, f in batch.token_factors)
          + f", spread {details['loaded'].get('residual_std', 0.0):.1%} "
          f"({details['loaded'].get('batches', 0)} batches)")
    return service.to_dict(), details


def _table(name: str, padding: str, model: CostModel, points: list[Measurement], loo: list[float],
           held: list[tuple[Measurement, float]]) -> Any:
    from rich.table import Table

    table = Table(title=f"profile of {name} ({padding}), fitted on {len(points)} shapes")
    for col in ("n", "len", "tokens", "median ms", "ms/token", "peak MB", "fit ms", "error"):
        table.add_column(col, justify="right")
    for i, m in enumerate(points):
        toks = m.n * m.padded_len
        table.add_row(str(m.n), str(m.padded_len), str(toks), f"{m.latency_s * 1e3:.1f}",
                      f"{m.latency_s * 1e3 / toks:.3f}", f"{m.memory_bytes / 2**20:.1f}",
                      f"{model.latency(m.features) * 1e3:.1f}", f"{loo[i]:+.0%} LOO" if loo else "-")
    for m, err in held:
        table.add_row(str(m.n), f"mix {min(m.lengths)}-{max(m.lengths)}", str(int(m.features["tokens"])),
                      f"{m.latency_s * 1e3:.1f}", "", "", f"{model.latency(m.features) * 1e3:.1f}",
                      f"{err:+.0%} held-out")
    return table


def _meta(ex: Any, args: argparse.Namespace, wall: float, summary: dict[str, float]) -> dict[str, Any]:
    import platform

    import torch

    cuda = ex.device.type == "cuda"
    return {
        "model": ex.model_name,
        "model_path": ex.model_path,
        "device": str(ex.device),
        "device_name": torch.cuda.get_device_name(ex.device) if cuda else platform.machine(),
        "torch": torch.__version__,
        "threads": ex.num_threads,
        "thread_plan": ex.threads.to_json(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "forward": ex.forward_impl,
        "padding": args.padding,
        "repeats": args.repeats,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "memory": "torch.cuda.max_memory_allocated above the pre-call level" if cuda
        else "peak live tensor bytes from torch.profiler CPU allocator events (docs/profiler.md)",
        "wall_s": round(wall, 2),
        "error": summary,
    }


def _error_summary(loo: list[float], held: list[float]) -> dict[str, float]:
    out: dict[str, float] = {}
    if loo:
        out["leave-one-out median |err|"] = statistics.median(abs(e) for e in loo)
        out["leave-one-out max |err|"] = max(abs(e) for e in loo)
    if held:
        out["held-out median |err|"] = statistics.median(abs(e) for e in held)
        out["held-out max |err|"] = max(abs(e) for e in held)
    return out
