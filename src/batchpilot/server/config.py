"""Server settings: what the HTTP layer needs (where to bind, what to load, the guards).

What the server decides about requests lives in the deployment (``core.deployment``, read from the
config file by ``settings``): ``ServerConfig.serving`` holds its ``server:`` section
(``core.deployment.ServingOptions``) as resolved, so each of those settings (the request timeout, the
tokenizer threads) is stated and defaulted once, there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchpilot.core.deployment import LLM_PRECISIONS, ServingOptions
from batchpilot.server.llm.schemas import LLMLimits
from batchpilot.settings import flag

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # 2048 inputs of a few KB of text each
TASKS = ("auto", "embed", "score", "classify")


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: a local HF folder (None: the embedded all-MiniLM-L6-v2), the name clients
    send (default: the folder's name), its task (``auto``: from the checkpoint, ``models.tasks``) and
    its cost-model profile (None: measured briefly at start-up)."""

    path: str | None = None
    name: str | None = None
    task: str = "auto"
    profile: str | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task = {self.task!r}; choose one of {', '.join(TASKS)}")


# serve's request-limit flags, in their --help order (each a ``ServerConfig`` field of the same name)
REQUEST_LIMITS = ("max_body_bytes", "header_timeout_s", "keep_alive_s", "body_timeout_s", "send_timeout_s",
                  "max_json_values", "max_json_containers", "max_inputs", "max_input_chars",
                  "max_input_tokens")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    models: tuple[ModelSpec, ...] = (ModelSpec(),)  # each with its own scheduler; the first is the default
    max_length: int | None = None  # None: the model's position limit
    num_threads: int | None = None  # torch intra-op threads, fixed; None: a measured per-batch plan
    # the deployment's ``server:`` section as resolved (flags on the file): the request timeout (504),
    # the tokenizer threads per model (0: one per core) and the admission limits; serve passes
    # ``DeploymentSpec.server`` on as it is
    serving: ServingOptions = ServingOptions()
    noop: bool = False  # a model that costs nothing (benchmarks of the serving path)
    noop_delay_s: float = 0.0
    startup_profile: bool = True  # no profile given: measure briefly at start-up (else the stated default)
    api_key: str | None = None  # Bearer key on every route but /health
    api_keys: str | None = None  # the keys file: keys -> tenants, weights, quotas (server/tenants.py)
    # the request limits (serve's flags of the same names, ``REQUEST_LIMITS``; their help is the metadata)
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, metadata=flag(
        "request bodies over this get 413 (default: %(default)s, 16 MiB)"))
    max_inputs: int = field(default=2048, metadata=flag(  # per request, as OpenAI
        "embedding inputs per request (default: %(default)s, as OpenAI)"))
    # per text input (tokenising is paid per character, truncated or not)
    max_input_chars: int = field(default=65536, metadata=flag(
        "characters per embedding text, truncated or not (default: %(default)s)"))
    max_input_tokens: int = field(default=8192, metadata=flag(  # as OpenAI's per-input limit
        "token ids per embedding token-id input, before truncation (default: %(default)s, as OpenAI)"))
    # a request's line and headers must be complete this long after the connection opened or the
    # request's first byte, else 408 and the connection closed (header_timeout.py)
    header_timeout_s: float = field(default=10.0, metadata=flag(
        "a request line and headers not complete this long after the connection opened (or the request's "
        "first byte) get 408 and the connection closed (default: %(default)s)"))
    # an idle kept-alive connection is closed after this; longer than clients' own idle expiry (httpx,
    # openai: 5 s), so that a client never reuses a connection the server is closing (header_timeout.py)
    keep_alive_s: float = field(default=30.0, metadata=flag(
        "an idle kept-alive connection is closed after this; keep it above the clients' idle expiry "
        "(httpx, openai: 5 s) (default: %(default)s)"))
    # the whole body must arrive within this from its headers, else 408
    body_timeout_s: float = field(default=30.0, metadata=flag(
        "a body not fully arrived this long after its headers gets 408 and the connection closed "
        "(default: %(default)s)"))
    # a client that reads nothing of its response for this long is dropped
    send_timeout_s: float = field(default=30.0, metadata=flag(
        "a client that reads none of its response for this long is dropped (default: %(default)s)"))
    # a body's JSON values (about twice 2048 lists of 512 token ids)
    max_json_values: int = field(default=2_097_152, metadata=flag(
        "JSON values per body, checked before parsing; over it: 413 (default: %(default)s)"))
    # a body's JSON objects and arrays (32x what 2048 token lists need)
    max_json_containers: int = field(default=65_536, metadata=flag(
        "JSON objects and arrays per body, checked before parsing; over it: 413 (default: %(default)s)"))
    drain_timeout_s: float = 30.0  # on shutdown, how long in-flight work may take
    warmup: bool = True
    llm: bool = False
    llm_model: str | None = None
    llm_profile: str | None = None  # the `profile --llm` file the KV pool is planned from (llm_memory.py)
    # the LLM's weights and activations: auto (the fastest that passes the guard, models/llm/precision.py;
    # a --llm-profile's precision when given one) | float32 | bfloat16 | float16
    llm_dtype: str = "auto"
    llm_kv_dtype: str | None = None  # the KV cache's (None: the weights')
    llm_limits: LLMLimits = LLMLimits()  # sizes of one LLM request (llm_limits.py; serve's --llm-max-* flags)
    batch_log: str | None = None  # append one JSON line per executed encoder batch here (fidelity checks)
    llm_step_log: str | None = None  # append one JSON line per LLM engine step here (fidelity checks)
    llm_fallback: str = "static"  # what serves while the LLM engine is failed: static (HF generate) | off
    llm_stall_timeout_s: float | None = None  # an LLM step past this is a stall (None: from step times)
    # an embedding model whose served path is not padded float32 gets the padded float32 path as a
    # fallback (a second copy of the weights) for when that path fails repeatedly
    encoder_fallback: bool = True
    encoder_stall_timeout_s: float | None = None  # an encoder batch past this is a stall (None: measured)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("server.models is empty; serve at least one model")
        if not 0 <= self.port < 65536:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        for name in ("max_body_bytes", "max_inputs", "max_input_chars", "max_input_tokens", "max_json_values",
                     "max_json_containers"):
            if getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("drain_timeout_s", "header_timeout_s", "keep_alive_s",
                     "body_timeout_s", "send_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"server.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.noop_delay_s < 0:
            raise ValueError(f"server.noop_delay_s must be >= 0, got {self.noop_delay_s}")
        if self.llm_dtype not in LLM_PRECISIONS:
            raise ValueError(f"server.llm_dtype = {self.llm_dtype!r}; choose one of "
                             f"{', '.join(LLM_PRECISIONS)}")
        if self.llm_kv_dtype is not None and self.llm_kv_dtype not in LLM_PRECISIONS[1:]:
            raise ValueError(f"server.llm_kv_dtype = {self.llm_kv_dtype!r}; choose one of "
                             f"{', '.join(LLM_PRECISIONS[1:])}")
        if self.llm_fallback not in ("static", "off"):
            raise ValueError(f"server.llm_fallback = {self.llm_fallback!r}; choose static or off")
        if self.llm_stall_timeout_s is not None and not self.llm_stall_timeout_s > 0:
            raise ValueError(f"server.llm_stall_timeout_s must be > 0 seconds, "
                             f"got {self.llm_stall_timeout_s}")
        if self.encoder_stall_timeout_s is not None and not self.encoder_stall_timeout_s > 0:
            raise ValueError(f"server.encoder_stall_timeout_s must be > 0 seconds, "
                             f"got {self.encoder_stall_timeout_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("server.api_key is empty; omit --api-key or give a non-empty key")
