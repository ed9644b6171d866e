"""Device helpers for the executors: pick a device, size the CPU thread pool, stage host->device copies.

On CUDA the collation thread (``prepare``) overlaps the previous batch's ``run``: it fills *pinned* host
buffers and starts a non-blocking copy on a side stream, then records an event. ``run`` makes the
compute stream wait on that event (a GPU-side wait: the CPU never blocks on the copy) and marks the
tensors as used by the compute stream so the caching allocator does not recycle them under it.

On CPU there is nothing to stage: tensors are used where they are built.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available; use device='cpu' or 'auto'")
    return device


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op pool to ``num_threads`` (None = every available core); returns the count.

    torch's default already uses the physical cores, but a container's affinity mask can be smaller than
    what torch detects, and oversubscribed pools thrash: one thread per core we may actually run on.
    """
    n = available_cores() if num_threads is None else num_threads
    if n < 1:
        raise ValueError(f"num_threads must be >= 1 (or None for every core), got {n}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def bind_threads(device: Any, num_threads: int | None) -> int | None:
    """``configure_threads(num_threads)`` for the calling thread when ``device`` is a CPU (else nothing,
    None): the first thing a thread that runs a model does.

    torch keeps an intra-op thread count per thread. A thread's count is taken at its first op from the
    last process-wide ``torch.set_num_threads``, whichever thread made it and for whichever model, and
    is kept for the thread's life; later calls from other threads do not reach it. A server's LLM
    engine thread that did not set its own ran with what the encoder's thread plan had last set for a
    short batch (one thread), in the processes where that came last, 8-12% slower than the others
    (docs/profiler.md, "Threads and OpenMP waiting")."""
    if device is None or torch.device(device).type != "cpu":
        return None
    return configure_threads(num_threads)


@dataclass
class Staged:
    """Tensors on their target device plus the event ``run`` must wait for (None on CPU)."""

    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None = None

    def wait(self) -> dict[str, torch.Tensor]:
        """Make the current stream wait for the copy; returns the tensors, safe to use on this stream."""
        if self.ready is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.ready)
            for t in self.tensors.values():
                t.record_stream(stream)
        return self.tensors


class HostToDevice:
    """Stage CPU tensors onto ``device``: pinned memory + side-stream copy on CUDA, a no-op on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self.is_cuda else None

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer to collate into: page-locked on CUDA (from torch's caching host allocator, so
        repeated batches reuse the same pages), ordinary memory on CPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def stage(self, tensors: dict[str, torch.Tensor]) -> Staged:
        if not self.is_cuda:
            return Staged(tensors)
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            # only a copy from pinned memory is truly asynchronous; pin whatever was not built pinned
            moved = {
                k: (v if v.is_pinned() else v.pin_memory()).to(self.device, non_blocking=True)
                for k, v in tensors.items()
            }
            event = torch.cuda.Event()
            event.record(self._stream)
        return Staged(moved, event)


def memory_bytes(device: torch.device | str) -> float:
    """The memory a batch budget is a share of: the GPU's total memory, or the machine's (CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def free_memory_bytes(device: torch.device | str) -> float | None:
    """Memory free for a new allocation now: CUDA's ``mem_get_info`` free bytes, or the kernel's
    ``MemAvailable`` estimate on CPU (what can be allocated without swapping); None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def used_memory_bytes(device: torch.device | str) -> float:
    """Device memory this process holds now: tensors allocated by torch on CUDA, the resident set on CPU
    (everything: weights, KV pool pages written so far, the allocator's cached pages, Python)."""
    device = torch.device(device)
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> float:
    """Peak bytes allocated by torch *while* ``fn`` runs, above what was allocated when it started.

    CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak (the caching allocator's own
    high-water mark of live tensor bytes).
    CPU: torch has no allocator statistics, so ``fn`` runs once under ``torch.profiler`` with
    ``profile_memory=True``; every allocation and free of the CPU allocator is an event with a signed
    byte count, and the running sum of those events, in time order, peaks at the answer. It counts
    tensor memory only (activations, attention scores, outputs) — not weights loaded before, not
    Python objects or the allocator's free-but-cached pages — which is what grows with the batch shape.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # the raw event list: profile.events() folds allocations inside an op into that op's totals
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    events.sort(key=lambda e: e.start_ns())
    level = peak = 0
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    return float(peak)


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Kineto prints a 'profiler_start/stop' line to file descriptor 2 around every profile (C++, so
    ``sys.stderr`` cannot catch it); it would tear through the progress bar. Mute the fd meanwhile."""
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (some embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
