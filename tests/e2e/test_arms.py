"""A model served in arms on a real server: assignment by client, arm labels on every metric, /v1/arms,
rollback of a failing candidate with nobody answered twice or lost, and taking it back by the admin route."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import running_server
from inproc import live_server, scrape

from batchpilot.core.config import SchedulerConfig
from batchpilot.core.deployment import DeploymentSpec
from batchpilot.core.rollout import ArmSpec, RollbackRules, RolloutSpec
from batchpilot.runtime.executor import NoopExecutor
from batchpilot.server.app import ServedArm, ServedModel
from batchpilot.sim.arms import assign

KEY = "arms-admin"


class OutOfMemoryExecutor(NoopExecutor):
    """A candidate whose every batch fails the way a device out of memory does."""

    def run(self, prepared: list[Any]) -> list[Any]:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def armed(candidate: NoopExecutor, share: float = 0.5, **rules: Any) -> ServedModel:
    rollout = RolloutSpec((ArmSpec("canary", share, DeploymentSpec()),), rules=RollbackRules(**rules))
    return ServedModel(NoopExecutor(), SchedulerConfig(), name="noop", rollout=rollout,
                       arms=(ServedArm(candidate, SchedulerConfig()),))


async def fire(url: str, clients: int, rounds: int) -> list[tuple[str, int, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        async def one(i: int) -> tuple[str, int, str]:
            r = await c.post("/v1/embeddings", json={"input": "hello world"},
                             headers={"x-client-id": f"client-{i}", "authorization": f"Bearer {KEY}"})
            return f"client-{i}", r.status_code, r.headers.get("x-batchpilot-arm", "")
        out: list[tuple[str, int, str]] = []
        for _ in range(rounds):
            out += await asyncio.gather(*(one(i) for i in range(clients)))
        return out


def test_each_client_stays_on_its_arm_and_every_metric_names_the_arm() -> None:
    # rollback off: two identical arms answering in well under a millisecond can differ 2x on noise
    # (a cold process's first requests), and a rollback would move clients (that is tested below)
    with live_server(None, models=[armed(NoopExecutor(), enabled=False)], api_key=KEY) as srv:
        answers = asyncio.run(fire(srv.url, 40, 5))
        arms_of = collections.defaultdict(set)
        for client, status, arm in answers:
            assert status == 200
            arms_of[client].add(arm)
        assert all(len(a) == 1 for a in arms_of.values())
        split = collections.Counter(next(iter(a)) for a in arms_of.values())
        assert set(split) == {"primary", "canary"}
        # the simulator assigns the same clients to the same arms (sim.arms)
        clients = sorted(arms_of)
        predicted = assign(clients, RolloutSpec((ArmSpec("canary", 0.5),)))
        assert [next(iter(arms_of[c])) for c in clients] == [["primary", "canary"][i] for i in predicted]
        metrics = scrape(srv.url, {"authorization": f"Bearer {KEY}"}, by_model=True)
        for arm in ("primary", "canary"):
            served = metrics[f'batchpilot_http_requests_total{{arm={arm},model=noop,route=/v1/embeddings,'
                             'status=200}']
            assert served == 5 * split[arm]
            assert f"batchpilot_arm_share{{arm={arm},model=noop}}" in metrics
        status = httpx.get(srv.url + "/v1/arms", headers={"authorization": f"Bearer {KEY}"}).json()
        [model] = status["data"]
        assert [a["arm"] for a in model["arms"]] == ["primary", "canary"]
        assert sum(a["answers"] for a in model["arms"]) == 200
        assert model["comparisons"][0]["candidate"] == "canary"
        assert httpx.get(srv.url + "/health").json()["arms"] == {"noop": {"primary": "serving",
                                                                         "canary": "serving"}}


def test_a_failing_candidate_is_rolled_back_and_its_requests_answered_by_the_primary() -> None:
    with live_server(None, models=[armed(OutOfMemoryExecutor(), share=0.5, max_faults=3)],
                     api_key=KEY) as srv:
        headers = {"authorization": f"Bearer {KEY}"}
        answers = asyncio.run(fire(srv.url, 20, 1))
        failures = "batchpilot_batch_failures_total{arm=canary,model=noop}"
        failed = scrape(srv.url, headers, by_model=True)[failures]
        assert failed >= 3  # the faults that decided it ran on the candidate
        answers += asyncio.run(fire(srv.url, 20, 4))
        assert len(answers) == 100 and all(status == 200 for _, status, _ in answers)  # none lost
        assert all(arm == "primary" for _, _, arm in answers)  # the candidate answered nobody
        health = httpx.get(srv.url + "/health").json()
        assert health["status"] == "ok" and health["arms"]["noop"]["canary"] == "rolled_back"
        metrics = scrape(srv.url, headers, by_model=True)
        assert metrics["batchpilot_arm_share{arm=canary,model=noop}"] == 0.0
        assert metrics["batchpilot_arm_rolled_back{arm=canary,model=noop}"] == 1.0
        assert metrics["batchpilot_arm_rollbacks_total{arm=canary,model=noop,rule=faults}"] == 1.0
        # nothing was sent to it after the rollback
        assert metrics[failures] == failed
        canary = httpx.get(srv.url + "/v1/arms", headers=headers).json()["data"][0]["arms"][1]
        assert canary["state"] == "rolled_back" and canary["rollback"]["rule"] == "faults"
        # the admin route is behind the API key, and takes the arm back
        assert httpx.post(srv.url + "/v1/arms/canary/enable").status_code == 401
        back = httpx.post(srv.url + "/v1/arms/canary/enable", headers=headers).json()
        assert back["changed"] and back["states"]["canary"] == "serving"
        assert httpx.post(srv.url + "/v1/arms/primary/disable", headers=headers).status_code == 400
        assert httpx.post(srv.url + "/v1/arms/nope/disable", headers=headers).status_code == 404


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_shares_at_the_edges_send_everyone_to_one_arm(share: float) -> None:
    with live_server(None, models=[armed(NoopExecutor(), share=share)], api_key=KEY) as srv:
        arms = {arm for _, _, arm in asyncio.run(fire(srv.url, 30, 1))}
        assert arms == ({"canary"} if share == 1.0 else {"primary"})


def test_serve_canary_from_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "b.yaml").write_text("encoder:\n  policy: {name: window, max_batch_size: 2}\n")
    (tmp_path / "a.yaml").write_text("encoder:\n  policy: {name: hybrid, max_batch_size: 8}\n"
                                     "arms:\n  candidates:\n    - {name: wide, share: 0.2, "
                                     "encoder: {policy: {name: hybrid, max_batch_size: 16}}}\n")
    args = ["--noop", "--no-warmup", "--config", str(tmp_path / "a.yaml"), "--canary",
            str(tmp_path / "b.yaml"), "--canary-share", "0.3", "--rollback-min-samples", "50"]
    with running_server(args, tmp_path) as url:
        assert httpx.get(url + "/health").json()["arms"]["noop"] == {"primary": "serving", "wide": "serving",
                                                                    "canary": "serving"}
        answers = asyncio.run(fire(url, 60, 1))
        assert {arm for _, _, arm in answers} == {"primary", "wide", "canary"}
        [model] = httpx.get(url + "/v1/arms").json()["data"]
        sizes = {a["arm"]: a["config"]["max_batch_size"] for a in model["arms"]}
        assert sizes == {"primary": 8, "wide": 16, "canary": 2}
        assert model["rules"]["min_samples"] == 50


class SlowFailure(NoopExecutor):
    """A candidate that fails each batch after 150 ms."""

    def run(self, prepared: list[Any]) -> list[Any]:
        import time

        time.sleep(0.15)
        raise RuntimeError("device lost")


def test_a_retry_on_the_primary_keeps_the_requests_deadline() -> None:
    with live_server(None, models=[armed(SlowFailure(), share=1.0)], api_key=KEY) as srv:
        headers = {"authorization": f"Bearer {KEY}", "x-client-id": "c1"}
        late = httpx.post(srv.url + "/v1/embeddings", json={"input": "hi"},
                          headers={**headers, "x-deadline-ms": "100"}, timeout=30)
        assert late.status_code in (429, 504)  # its 100 ms were spent on the candidate
        ok = httpx.post(srv.url + "/v1/embeddings", json={"input": "hi"}, headers=headers, timeout=30)
        assert ok.status_code == 200 and ok.headers["x-batchpilot-arm"] == "primary"
