"""The LLM served in arms on a real server: an engine per arm over the same weights, clients kept on
their arm, arm-labelled metrics, KV state per arm in /v1/arms, and a failing candidate rolled back
with every request answered by the primary."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from inproc import live_server, scrape, small_llm_engine

from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.rollout import ArmSpec, RollbackRules, RolloutSpec
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.runtime.llm.build import build_llm_arm
from batchpilot.server.app import MountedEngine
from batchpilot.server.arms import LLMArms
from batchpilot.server.llm.routes import make_llm_router


@pytest.fixture()
def canary() -> Iterator[Any]:
    arm = build_llm_arm(small_llm_engine(), max_num_seqs=2, num_kv_blocks=32)
    yield arm
    arm.shutdown()


def serve_arms(canary: Any, **rules: Any) -> Any:
    rollout = RolloutSpec((ArmSpec("canary", 0.5, DeploymentSpec()),), rules=RollbackRules(**rules))
    arms = LLMArms([small_llm_engine(), canary], rollout)
    llm = MountedEngine(lambda registry: make_llm_router(small_llm_engine(), registry, arms=arms), "tiny-llm",
                        arms=(arms.armed,))
    return live_server(NoopExecutor(), engines=[llm])


async def complete_all(url: str, clients: int, stream: bool = False) -> list[tuple[str, int, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async def one(i: int) -> tuple[str, int, str]:
            body = {"prompt": f"hello {i}", "max_tokens": 3, "stream": stream}
            r = await c.post("/v1/completions", json=body, headers={"x-client-id": f"user-{i}"})
            return f"user-{i}", r.status_code, r.headers.get("x-batchpilot-arm", "")
        return list(await asyncio.gather(*(one(i) for i in range(clients))))


def test_each_client_gets_its_arms_engine_and_the_arms_show_their_kv(canary: Any) -> None:
    with serve_arms(canary) as srv:
        first = asyncio.run(complete_all(srv.url, 16))
        again = asyncio.run(complete_all(srv.url, 16, stream=True))
        assert all(status == 200 for _, status, _ in first + again)
        assert {c: a for c, _, a in first} == {c: a for c, _, a in again}  # stable per client
        split = collections.Counter(a for _, _, a in first)
        assert set(split) == {"primary", "canary"}
        m = scrape(srv.url)
        served = {arm: sum(v for k, v in m.items() if k.startswith("batchpilot_llm_requests_total{")
                           and f"arm={arm}" in k) for arm in ("primary", "canary")}
        assert served == {arm: 2 * n for arm, n in split.items()}
        [llm] = [a for a in httpx.get(srv.url + "/v1/arms").json()["data"] if a["model"] == "tiny-llm"]
        cfg = {a["arm"]: a["config"] for a in llm["arms"]}
        assert cfg["canary"]["max_num_seqs"] == 2 and cfg["primary"]["max_num_seqs"] == 4
        assert cfg["canary"]["num_kv_blocks"] == 32 and 0.0 <= cfg["canary"]["kv_fragmentation"] <= 1.0
        assert httpx.get(srv.url + "/health").json()["arms"]["tiny-llm"]["canary"] == "serving"


def test_a_failing_candidate_engine_is_rolled_back_and_the_primary_answers(canary: Any) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("kernel failed")

    canary.runner.forward = broken
    with serve_arms(canary, max_faults=3) as srv:
        answers = asyncio.run(complete_all(srv.url, 16)) + asyncio.run(complete_all(srv.url, 16))
        assert [s for _, s, _ in answers] == [200] * 32  # nobody saw the candidate fail
        assert {a for _, _, a in answers} == {"primary"}
        assert httpx.get(srv.url + "/health").json()["arms"]["tiny-llm"]["canary"] == "rolled_back"
        m = scrape(srv.url, by_model=True)
        assert m["batchpilot_arm_rollbacks_total{arm=canary,model=tiny-llm,rule=faults}"] == 1.0


def test_serve_llm_with_a_canary_builds_an_engine_per_arm(tmp_path: Any) -> None:
    from conftest import running_server

    (tmp_path / "b.yaml").write_text("llm: {max_num_seqs: 2}\n")
    args = ["--noop", "--no-warmup", "--llm", "--num-kv-blocks", "64", "--max-num-seqs", "4", "--threads",
            "1", "--canary", str(tmp_path / "b.yaml"), "--canary-share", "0.5"]
    with running_server(args, tmp_path) as url:
        answers = asyncio.run(complete_all(url, 12))
        assert all(s == 200 for _, s, _ in answers) and {a for _, _, a in answers} == {"primary", "canary"}
        data = {m["model"]: m for m in httpx.get(url + "/v1/arms").json()["data"]}
        assert set(data) == {"noop", "batchpilot-tiny-llama"}  # the encoder's arms and the LLM's
        llm = {a["arm"]: a["config"]["max_num_seqs"] for a in data["batchpilot-tiny-llama"]["arms"]}
        assert llm == {"primary": 4, "canary": 2}
