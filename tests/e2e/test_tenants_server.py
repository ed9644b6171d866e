"""Tenants on the real server (no-op model, free 127.0.0.1 port, real httpx and openai clients): the keys
file (401 / 200, the key's tenant), a tenant's token quota (429 + Retry-After), GET /v1/tenants, per-tenant
metrics with bounded labels, and the keys file reloaded on SIGHUP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from batchpilot.bench.serverproc import free_port, wait_ready

KEYS = """\
tenants:
  alpha: {weight: 1}
  beta: {weight: 2, tokens_per_s: 8, burst_tokens: 16}
  ops: {admin: true}
keys:
  alpha-key-0001: alpha
  beta-key-0002: beta
  ops-key-00003: ops
"""


@contextmanager
def server(args: list[str], log_dir: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    log = log_dir / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "batchpilot.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--noop", "--no-warmup", "--no-startup-profile", "--log-level", "warning", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 120.0, proc, log)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    d = tmp_path_factory.mktemp("tenants")
    keys = d / "keys.yaml"
    keys.write_text(KEYS)
    with server(["--api-keys", str(keys)], d) as (url, proc):
        yield url, proc, keys


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_file_401_and_200(keyed: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    url = keyed[0]
    body = {"input": "one two three"}
    assert httpx.post(f"{url}/v1/embeddings", json=body).status_code == 401
    wrong = httpx.post(f"{url}/v1/embeddings", json=body, headers=bearer("alpha-key-0000"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{url}/v1/embeddings", json=body, headers=bearer("alpha-key-0001")).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200  # no key needed
    client = openai.OpenAI(api_key="alpha-key-0001", base_url=f"{url}/v1", max_retries=0)
    assert len(client.embeddings.create(model="noop", input=["a b", "c d e"]).data) == 2
    bad = openai.OpenAI(api_key="nope-nope-nope", base_url=f"{url}/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model="noop", input="a b")


def test_token_quota_429_with_retry_after(keyed: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    url = keyed[0]
    words = " ".join(["w"] * 10)  # 10 tokens on the no-op model: the burst of 16 holds one
    first = httpx.post(f"{url}/v1/embeddings", json={"input": words}, headers=bearer("beta-key-0002"))
    assert first.status_code == 200
    second = httpx.post(f"{url}/v1/embeddings", json={"input": words}, headers=bearer("beta-key-0002"))
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "quota_tokens"
    assert int(second.headers["retry-after"]) >= 1  # 4 more tokens at 8/s: rounded up to a second
    huge = httpx.post(f"{url}/v1/embeddings", json={"input": " ".join(["w"] * 40)},
                      headers=bearer("beta-key-0002"))
    assert huge.status_code == 429 and "retry-after" not in huge.headers  # over the burst: never
    # another tenant is not affected
    assert httpx.post(f"{url}/v1/embeddings", json={"input": words},
                      headers=bearer("alpha-key-0001")).status_code == 200


def test_tenants_view_is_for_admins(keyed: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    url = keyed[0]
    httpx.post(f"{url}/v1/embeddings", json={"input": "x y"}, headers=bearer("alpha-key-0001"))
    assert httpx.get(f"{url}/v1/tenants", headers=bearer("alpha-key-0001")).status_code == 403
    view = httpx.get(f"{url}/v1/tenants", headers=bearer("ops-key-00003"))
    assert view.status_code == 200
    data = view.json()
    assert data["tenants"]["beta"] == {"weight": 2.0, "tokens_per_s": 8.0, "burst_tokens": 16.0,
                                       "max_concurrent_requests": 0}
    usage = {u["tenant"]: u for u in data["models"]["noop"]}
    assert usage["alpha"]["requests"] >= 1 and usage["alpha"]["tokens"] >= 2
    assert usage["alpha"]["in_progress"] == 0 and usage["alpha"]["counter"] is None  # fcfs here
    if "beta" in usage:
        assert usage["beta"]["quota"]["tokens_per_s"] == 8.0


def test_per_tenant_metrics(keyed: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    url = keyed[0]
    httpx.post(f"{url}/v1/embeddings", json={"input": "x y"}, headers=bearer("alpha-key-0001"))
    text = httpx.get(f"{url}/metrics", headers=bearer("alpha-key-0001")).text
    assert 'batchpilot_tenant_requests_total{model="noop",tenant="alpha"}' in text
    assert 'batchpilot_tenant_request_latency_seconds_count{model="noop",tenant="alpha"}' in text


def test_sighup_reloads_the_keys_file(keyed: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    url, proc, keys = keyed
    new_key = bearer("gamma-key-0004")
    assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, headers=new_key).status_code == 401
    keys.write_text(KEYS.replace("keys:\n", "keys:\n  gamma-key-0004: alpha\n"))
    proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    status = 401
    while status != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        status = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, headers=new_key).status_code
    assert status == 200
    keys.write_text("tenants: [broken")  # a bad file is logged and ignored: the keys stay in force
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert proc.poll() is None
    assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, headers=new_key).status_code == 200


def test_unauthenticated_tenants_have_bounded_labels(tmp_path: Path) -> None:
    with server(["--config", str(_fair_config(tmp_path))], tmp_path) as (url, _):
        for i in range(20):
            r = httpx.post(f"{url}/v1/embeddings", json={"input": "a b"},
                           headers={"X-Client-Id": f"client-{i}"})
            assert r.status_code == 200
        httpx.post(f"{url}/v1/embeddings", json={"input": "a b", "user": "someone"})
        httpx.post(f"{url}/v1/embeddings", json={"input": "a b"})
        text = httpx.get(f"{url}/metrics").text
        labels = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
                  if line.startswith("batchpilot_tenant_requests_total{")}
        assert labels == {"other", "default"}
        view = httpx.get(f"{url}/v1/tenants").json()  # no keys: anyone may read it
        usage = {u["tenant"]: u for u in view["models"]["noop"]}
        assert usage["client-3"]["requests"] == 1 and usage["someone"]["requests"] == 1
        assert usage["client-3"]["counter"] is not None  # fair order: its virtual token counter


def _fair_config(d: Path) -> Path:
    cfg = d / "fair.yaml"
    cfg.write_text("encoder:\n  queue_order: fair\n")
    return cfg


def test_both_key_flags_are_refused(tmp_path: Path) -> None:
    keys = tmp_path / "k.yaml"
    keys.write_text(KEYS)
    out = subprocess.run([sys.executable, "-m", "batchpilot.cli", "serve", "--noop", "--api-key", "k" * 10,
                          "--api-keys", str(keys)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not both" in out.stderr
    keys.write_text("tenants: {a: {}}\nkeys: {some-key-000: b}\n")
    out = subprocess.run([sys.executable, "-m", "batchpilot.cli", "serve", "--noop", "--api-keys", str(keys)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "does not list" in out.stderr


def test_bench_replays_a_multi_tenant_workload(keyed: tuple[str, subprocess.Popen[bytes], Path],
                                               tmp_path: Path) -> None:
    url = keyed[0]
    out = subprocess.run([sys.executable, "-m", "batchpilot.cli", "bench", "--url", url, "--no-progress",
                          "--tenant", "alpha:rate=10", "--tenant", "ops:rate=5,start=500",
                          "--tenant-key", "alpha=alpha-key-0001", "--tenant-key", "ops=ops-key-00003",
                          "--duration-s", "2", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tenant alpha" in out.stdout and "tenant ops" in out.stdout
    view = httpx.get(f"{url}/v1/tenants", headers=bearer("ops-key-00003")).json()
    usage = {u["tenant"]: u for u in view["models"]["noop"]}
    assert usage["ops"]["requests"] >= 5
