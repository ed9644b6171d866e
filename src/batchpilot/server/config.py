"""Server settings, and how ``serve`` turns a tuned YAML plus command-line overrides into a SchedulerConfig.

The scheduling knobs stay in ``core.config.SchedulerConfig`` (the YAML the tuner writes, loaded as is);
``ServerConfig`` holds only what the HTTP layer needs: where to bind, what to load, the guards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..core.config import SchedulerConfig

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # 2048 inputs of a few KB of text each


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    model_path: str | None = None  # None: the embedded all-MiniLM-L6-v2
    model_name: str | None = None  # the name clients send (default: the folder's name)
    max_length: int | None = None  # None: the model's position limit
    num_threads: int | None = None  # torch intra-op threads; None: every core (1 when oversubscribed)
    noop: bool = False  # a model that costs nothing (benchmarks of the serving path)
    noop_delay_s: float = 0.0
    profile_path: str | None = None
    startup_profile: bool = True  # no profile given: measure briefly at start-up (else the stated default)
    api_key: str | None = None  # Bearer key on every route but /health
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_inputs: int = 2048  # per request, as OpenAI
    request_timeout_s: float = 60.0  # a request not answered by then gets 504 (and leaves the queue)
    drain_timeout_s: float = 30.0  # on shutdown, how long in-flight work may take
    warmup: bool = True
    llm: bool = False
    llm_model: str | None = None
    batch_log: str | None = None  # append one JSON line per executed encoder batch here (fidelity checks)
    llm_step_log: str | None = None  # append one JSON line per LLM engine step here (fidelity checks)
    log_level: str = "info"
    overload_limits: bool = True  # bound the queue from the SLA when the config leaves it unlimited

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        for name in ("max_body_bytes", "max_inputs"):
            if getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"server.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.noop_delay_s < 0:
            raise ValueError(f"server.noop_delay_s must be >= 0, got {self.noop_delay_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("server.api_key is empty; omit --api-key or give a non-empty key")


def load_scheduler_config(path: str | Path | None = None, *, policy: str | None = None,
                          max_batch_size: int | None = None, max_wait_ms: float | None = None,
                          padding: str | None = None, num_slots: int | None = None) -> SchedulerConfig:
    """The tuner's YAML (or the defaults), with the command-line overrides applied on top."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of scheduler settings, got {type(loaded).__name__}")
        data = loaded or {}
    cfg = SchedulerConfig.from_dict(data)
    pol: dict[str, Any] = {}
    if policy is not None:
        pol["name"] = policy
    if max_batch_size is not None:
        pol["max_batch_size"] = max_batch_size
    if max_wait_ms is not None:
        pol["max_wait_s"] = max_wait_ms / 1000.0
    if pol:
        cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, **pol))
    if padding is not None:
        cfg = dataclasses.replace(cfg, planner=dataclasses.replace(cfg.planner, padding=padding))
    if num_slots is not None:
        cfg = dataclasses.replace(cfg, num_slots=num_slots)
    return cfg


def fit_to_model(cfg: SchedulerConfig, model_max_length: int) -> SchedulerConfig:
    """Never admit or pad beyond what the model can run: clamp the config's length limits to the model's."""
    planner = cfg.planner
    admission = cfg.admission
    if planner.max_len > model_max_length:
        planner = dataclasses.replace(planner, max_len=model_max_length)
    if admission.max_length > model_max_length:
        admission = dataclasses.replace(admission, max_length=model_max_length)
    return dataclasses.replace(cfg, planner=planner, admission=admission)
