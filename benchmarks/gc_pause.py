"""How long one full garbage collection stops a batchpilot server, before and after ``freeze_heap``.

    .venv/bin/python benchmarks/gc_pause.py [--llm] [--rounds 3]

Loads what ``batchpilot serve`` loads (the default MiniLM encoder, or with ``--llm`` the default random
Llama engine, stopped), imports the server stack, then times ``gc.collect()`` (a generation-2
collection, the kind Python runs now and then while serving) ``--rounds`` times, then once more after
``server.gc_pauses.freeze_heap()`` — what the server does when it is ready.
"""

from __future__ import annotations

import argparse
import gc
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llm", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import batchpilot.server.app  # noqa: F401  - the server stack (FastAPI, uvicorn, prometheus)
    from batchpilot.server.gc_pauses import freeze_heap

    if args.llm:
        from batchpilot.runtime.llm_engine import build_llm_engine

        build_llm_engine(start=False)
    else:
        from batchpilot.models.encoder import EncoderConfig, EncoderExecutor

        EncoderExecutor(EncoderConfig())
    what = "LLM engine" if args.llm else "MiniLM encoder"
    for i in range(args.rounds):
        t = time.perf_counter()
        gc.collect()
        print(f"{what}: full collection {i + 1}: {(time.perf_counter() - t) * 1e3:.1f} ms "
              f"({len(gc.get_objects())} tracked objects)")
    frozen = freeze_heap()
    t = time.perf_counter()
    gc.collect()
    print(f"{what}: after freeze_heap ({frozen} objects frozen): {(time.perf_counter() - t) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
