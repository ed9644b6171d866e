"""The LLM engine's settings as command-line flags, the same for ``serve --llm`` and ``simulate --target
llm``: each overrides the config file's ``llm:`` section (``core/llm_config.py``; docs/llm.md)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.llm_config import PREEMPTION_MODES

LLM_FLAGS: dict[str, type] = {"max_num_seqs": int, "max_num_batched_tokens": int, "max_model_len": int,
                              "block_size": int, "num_kv_blocks": int, "max_waiting_seqs": int,
                              "max_priority_wait_s": float, "decode_run_tokens": int}


def add_llm_args(p: argparse.ArgumentParser) -> None:
    """The LLM engine's settings as flags (serve --llm, simulate --target llm): override ``llm:``."""
    from batchpilot.core.llm_scheduler import LLMSchedulerConfig

    g = p.add_argument_group("LLM engine (override the config file's llm: section; docs/llm.md)")
    d = LLMSchedulerConfig()
    for name, kind in LLM_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"llm.{name} (default {getattr(d, name)})")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help=f"llm.enable_chunked_prefill (default {d.enable_chunked_prefill})")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help=f"llm.enable_prefix_caching (default {d.enable_prefix_caching})")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None,
                   help=f"llm.policy (default {d.policy})")
    g.add_argument("--llm-request-timeout-s", type=float, default=None, dest="llm_request_timeout_s",
                   help=f"llm.request_timeout_s: a completion not done by then ends with 504 (or an SSE "
                        f"error event) and its sequence is freed (default: --request-timeout-s when "
                        f"given, else {d.request_timeout_s:g})")
    m = p.add_argument_group("LLM memory (docs/llm.md, \"Memory planning\")")
    m.add_argument("--kv-cache-memory", type=_size(""), default=None, metavar="SIZE",
                   help="llm.kv_cache_memory: bytes of KV cache (4GiB, 512MiB, 2e9); sizes the pool")
    m.add_argument("--memory-utilization", "--gpu-memory-utilization", type=float, default=None,
                   dest="memory_utilization", metavar="SHARE",
                   help="llm.memory_utilization: the share in (0, 1] of the device's free memory at start-up "
                        "the engine may use; the KV pool is what weights and the activation peak leave")
    m.add_argument("--swap-space", type=_size("gib"), default=None, metavar="SIZE",
                   help="llm.swap_space: host memory for swapped-out KV blocks (a bare number is GiB, "
                        "here and in the file; default: none, no swap)")
    m.add_argument("--preemption", choices=PREEMPTION_MODES, default=None,
                   help=f"llm.preemption: recompute, swap, or auto (swap when copying is cheaper than "
                        f"recomputing; default {d.preemption})")


def _size(default_unit: str) -> Callable[[str], int]:
    from batchpilot.core.sizes import parse_bytes

    def parse(text: str) -> int:
        try:
            return parse_bytes(text, default_unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return parse


def llm_from_args(spec: DeploymentSpec, args: argparse.Namespace) -> DeploymentSpec:
    """``spec`` with the LLM flags given on this command line applied to its ``llm:`` section (the
    section's own validation names what to change)."""
    names = (*LLM_FLAGS, "enable_chunked_prefill", "enable_prefix_caching", "kv_cache_memory",
             "memory_utilization", "swap_space", "preemption")
    given = {k: getattr(args, k, None) for k in names}
    if getattr(args, "scheduling_policy", None) is not None:
        given["policy"] = args.scheduling_policy
    if getattr(args, "llm_request_timeout_s", None) is not None:
        given["request_timeout_s"] = args.llm_request_timeout_s
    changed = {k: v for k, v in given.items() if v is not None}
    # a flag that sizes the pool replaces the file's way of sizing it
    if {"kv_cache_memory", "memory_utilization", "num_kv_blocks"} & set(changed):
        changed.setdefault("kv_cache_memory", None)
        changed.setdefault("memory_utilization", None)
    return (spec.replace(llm=dataclasses.replace(spec.llm, **changed), llm_given=frozenset(changed))
            if changed else spec)
