"""batchpilot: inference batching that keeps every request inside its latency budget."""

import os

# torch's OpenMP pool spin-waits between calls by default; on shared or oversubscribed cores the
# spinning threads starve each other and a 16 ms forward took ~1.9 s (docs/profiler.md). Passive
# waiting costs little on a quiet machine. It only works if set before torch is first imported,
# hence here; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = ["Batcher", "batch", "__version__"]


def __getattr__(name: str) -> object:
    # Lazy, so `import batchpilot` (and the CLI's --help) stays free of asyncio-side imports.
    if name in ("batch", "Batcher"):
        from batchpilot import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'batchpilot' has no attribute {name!r}")
