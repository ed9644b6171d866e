"""Who a request is for: the keys file, the tenant of a request, hot reload, and ``GET /v1/tenants``.

    --api-keys FILE   every request but /health needs ``Authorization: Bearer <key>`` of the file;
                      the key names its tenant (401 for any other); the file's tenants carry weights
                      and quotas (``core.tenants.TenantSpec``); SIGHUP reloads it
    --api-key KEY     one key, one tenant (``default``)
    neither           no authentication; the tenant is the ``X-Client-Id`` header, else the body's
                      ``user``, else ``default`` -- for fairness only, all with one default weight

The keys file (YAML)::

    tenants:
      search:   {weight: 4, tokens_per_s: 20000, burst_tokens: 40000, max_concurrent_requests: 64}
      batch:    {weight: 1, tokens_per_s: 5000}
      ops:      {admin: true}                       # may read GET /v1/tenants
    keys:
      sk-search-7f3a: search
      "sha256:5e88...": batch                        # the key's SHA-256 (hex): no secret in the file

Keys are compared by their SHA-256 digests (a presented key is hashed and looked up by its digest), so
the time to accept or refuse a key says nothing about how much of it was right. A file that does not
parse, names a tenant that ``tenants:`` does not list, or holds no key is refused at start-up, and on
reload is logged and ignored (the previous keys stay in force).

Metric labels are bounded: a tenant is labelled with its name when the keys file (or ``--api-key``)
names it, else ``other`` (``Tenancy.label``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from batchpilot.core.request import DEFAULT_TENANT
from batchpilot.core.scheduler import BatchScheduler
from batchpilot.core.tenants import TenantSpec, TenantState, TenantTable, TenantUsage
from batchpilot.server.errors import APIError

if TYPE_CHECKING:
    from batchpilot.runtime.llm.engine import Engine

log = logging.getLogger("batchpilot.server")

OTHER = "other"  # the metric label of a tenant the keys file does not name
TENANT_KEY = "tenant"  # scope["state"] key: the tenant the middleware identified (absent: none yet)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,64}")
_SHA = "sha256:"


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


@dataclass(frozen=True)
class KeysFile:
    """A parsed keys file: the tenants' table, each key's digest -> its tenant, the admin tenants."""

    table: TenantTable
    keys: Mapping[bytes, str]
    admins: frozenset[str] = frozenset()
    path: str = ""

    @classmethod
    def load(cls, path: str | Path) -> KeysFile:
        """Read and validate ``path``; ``ValueError`` naming the file and the problem."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"keys file {path}: {exc}") from None
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: object, where: str = "keys file") -> KeysFile:
        if not isinstance(data, dict) or set(data) - {"tenants", "keys"}:
            raise ValueError(f"{where}: expected a mapping with the sections tenants: and keys:")
        tenants, keys = data.get("tenants") or {}, data.get("keys") or {}
        if not isinstance(tenants, dict) or not isinstance(keys, dict):
            raise ValueError(f"{where}: tenants: and keys: must be mappings (name -> spec, key -> tenant)")
        specs, admins = {}, set()
        for name, raw in tenants.items():
            entry = dict(raw or {})
            if entry.pop("admin", False):
                admins.add(str(name))
            specs[str(name)] = TenantSpec.from_dict(entry, f"{where}: tenants.{name}")
        digests: dict[bytes, str] = {}
        for key, tenant in keys.items():
            key = str(key)
            if str(tenant) not in specs:
                raise ValueError(f"{where}: a key names tenant {tenant!r}, which tenants: does not list")
            if key.startswith(_SHA):
                try:
                    d = bytes.fromhex(key[len(_SHA):])
                except ValueError:
                    d = b""
                if len(d) != 32:
                    raise ValueError(f"{where}: {key[:16]}...: a sha256: key is 64 hex digits")
            elif len(key) < 8:
                raise ValueError(f"{where}: a key of tenant {tenant!r} has {len(key)} characters; use >= 8")
            else:
                d = digest(key)
            digests[d] = str(tenant)
        if not digests:
            raise ValueError(f"{where}: keys: is empty; every request would be refused")
        return cls(TenantTable(specs), digests, frozenset(admins), where)


@dataclass
class Tenancy:
    """The server's identities: the keys (a ``KeysFile``, one ``--api-key``, or none), the tenants' table
    every scheduler applies, and ``reload`` (SIGHUP) that re-reads the file and hands the new table to
    each ``on_table`` listener (the models' schedulers)."""

    keys: KeysFile | None = None
    keys_path: str | None = None
    on_table: list[Callable[[TenantTable], None]] = field(default_factory=list)

    @classmethod
    def of(cls, keys_path: str | None, api_key: str | None) -> Tenancy:
        if keys_path is not None and api_key is not None:
            raise ValueError("give --api-keys FILE or --api-key KEY, not both (a key file can hold that key)")
        if keys_path is not None:
            return cls(KeysFile.load(keys_path), keys_path)
        if api_key is not None:
            one = TenantTable({DEFAULT_TENANT: TenantSpec()})
            return cls(KeysFile(one, {digest(api_key): DEFAULT_TENANT}))
        return cls()

    @property
    def requires_key(self) -> bool:
        return self.keys is not None

    @property
    def table(self) -> TenantTable:
        return self.keys.table if self.keys is not None else TenantTable()

    def authenticate(self, authorization: bytes | None) -> str | None:
        """The tenant of an ``Authorization: Bearer <key>`` header value, or None (refuse it)."""
        if self.keys is None or not authorization or not authorization.startswith(b"Bearer "):
            return None
        return self.keys.keys.get(digest(authorization[7:].strip()))

    def label(self, tenant: str) -> str:
        """The metric label of ``tenant``: its name when the keys name it, ``default`` for the default
        tenant, else ``other`` (a client's own name for itself never becomes a label)."""
        if tenant == DEFAULT_TENANT or (self.keys is not None and tenant in self.keys.table):
            return tenant
        return OTHER

    def is_admin(self, tenant: str | None) -> bool:
        """Whether ``tenant`` may read ``GET /v1/tenants``: any client without keys, the keys file's
        ``admin: true`` tenants, and the one tenant of ``--api-key``."""
        if self.keys is None:
            return True
        if not self.keys_path:
            return tenant == DEFAULT_TENANT
        return tenant in self.keys.admins

    def reload(self) -> bool:
        """Re-read the keys file; on success every listener gets the new table. On failure the keys in
        force stay, and the log says why."""
        if self.keys_path is None:
            log.info("SIGHUP: no --api-keys file to reload")
            return False
        try:
            keys = KeysFile.load(self.keys_path)
        except ValueError as exc:
            log.error("keys file not reloaded, the previous keys stay in force: %s", exc)
            return False
        self.keys = keys
        for listener in self.on_table:
            listener(keys.table)
        log.info("keys file %s reloaded: %d keys, %d tenants", self.keys_path, len(keys.keys),
                 len(keys.table.specs))
        return True


def client_tenant(headers: Mapping[bytes, bytes]) -> str | None:
    """The tenant an unauthenticated client names with ``X-Client-Id`` (None: none, or not a sane name)."""
    raw = headers.get(b"x-client-id")
    if raw is None:
        return None
    text = raw.decode("latin-1")
    return text if _CLIENT_ID.fullmatch(text) else None


def tenant_of(request: Request, user: str | None = None) -> str:
    """A request's tenant: the one its key names (or, without keys, its ``X-Client-Id``), else the
    body's ``user`` (a server with keys always has the key's), else ``default``."""
    state = request.scope.get("state") or {}
    tenant = state.get(TENANT_KEY)
    if tenant is not None:
        return str(tenant)
    if user and _CLIENT_ID.fullmatch(user):
        return user
    return DEFAULT_TENANT


def usage_json(scheduler: BatchScheduler, now: float) -> list[dict[str, object]]:
    """One JSON object per tenant the scheduler tracks (``BatchScheduler.tenant_usage``)."""
    return [_usage_row(u) for u in scheduler.tenant_usage(now)]


def ledger_json(states: Sequence[tuple[str, TenantState]], now: float | None = None,
                fair: Mapping[str, tuple[float, int]] | None = None) -> list[dict[str, object]]:
    """One JSON object per tenant of an LLM engine's admission (``LLMEngine.tenant_usage``), in the
    shape of ``usage_json``'s; the counter and waiting count from ``fair`` (the engine's last snapshot,
    ``EngineStats.tenant_counters``: empty but under ``policy: fair``)."""
    now = time.monotonic() if now is None else now  # the engine's clock
    fair = fair or {}
    return [_usage_row(TenantUsage.of(name, st, now, *fair.get(name, (None, 0)))) for name, st in states]


def engine_usage_json(engine: Engine) -> list[dict[str, object]]:
    """``ledger_json`` of an LLM engine: its admission's tenants and its
    fair order's counters, as ``GET /v1/tenants`` shows them under ``"llm"``."""
    return ledger_json(engine.tenant_usage(), fair=engine.stats().tenant_counters)


def _usage_row(u: TenantUsage) -> dict[str, object]:
    bucket = None if u.bucket_tokens is None else round(u.bucket_tokens, 1)
    return {"tenant": u.tenant, "weight": u.weight, "requests": u.requests, "tokens": u.tokens,
            "in_progress": u.in_progress, "waiting": u.waiting, "counter": u.counter,
            "quota": {"tokens_per_s": u.tokens_per_s, "bucket_tokens": bucket,
                      "max_concurrent_requests": u.max_concurrent_requests},
            "rejected": u.rejected}


def tenants_router(tenancy: Tenancy, schedulers: Callable[[], Sequence[tuple[str, BatchScheduler]]],
                   clock: Callable[[], float], extra: Callable[[], dict[str, object]] | None = None
                   ) -> APIRouter:
    """``GET /v1/tenants``: for each model, what each tenant has used, its counter under the fair order
    and its quota state; the keys file's tenants with their specs. Admins only (``Tenancy.is_admin``)."""
    router = APIRouter()

    @router.get("/v1/tenants")
    async def tenants(request: Request) -> JSONResponse:
        tenant = (request.scope.get("state") or {}).get(TENANT_KEY)
        if not tenancy.is_admin(tenant):
            raise APIError(403, f"tenant {tenant!r} may not read /v1/tenants (admin: true in the keys file)",
                           code="forbidden")
        now = clock()
        table = tenancy.table
        body: dict[str, object] = {
            "object": "tenants",
            "keys_file": tenancy.keys_path,
            "tenants": {name: _spec_json(s) for name, s in sorted(table.specs.items())},
            "models": {name: usage_json(s, now) for name, s in schedulers()},
        }
        if extra is not None:
            body.update(extra())
        return JSONResponse(_finite(body))

    return router


def _spec_json(s: TenantSpec) -> dict[str, float]:
    burst = s.burst if s.tokens_per_s else 0
    return {"weight": s.weight, "tokens_per_s": s.tokens_per_s, "burst_tokens": burst,
            "max_concurrent_requests": s.max_concurrent_requests}


def _finite(value: object) -> object:
    """JSON has no infinity: None in its place."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
