"""What applications code against, end to end with the official ``openai`` client on a real server:
structured outputs (response_format, structured_outputs, guided_*), forced tool calls, logprobs, n and
best_of, penalties, logit_bias and min_tokens, streamed and not (the seeded random model: a grammar's
mask needs no trained model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from inproc import live_server, llm_routes

from batchpilot.runtime.executor import NoopExecutor
from batchpilot.runtime.llm.build import build_llm_engine

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "units": {"enum": ["C", "F"]}}, "required": ["city", "days", "units"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "alarm", "parameters": {
             "type": "object", "properties": {"at": {"type": "string",
                                                     "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
             "required": ["at"], "additionalProperties": False}}}]
CHAT = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    engine = build_llm_engine(None, num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                              num_attention_heads=4, num_key_value_heads=2, num_kv_blocks=256, block_size=16,
                              max_num_batched_tokens=512, max_model_len=1024, model_name="m",
                              initializer_range=0.06)  # peaky: greedy has no near-ties (docs/llm.md)
    try:
        with live_server(NoopExecutor(), engines=[llm_routes(engine, "m")]) as srv:
            yield srv.url, engine
    finally:
        engine.shutdown()


@pytest.fixture
def client(served: tuple[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def schema_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}


def test_json_schema_answers_validate_on_both_routes_streamed_or_not(client: openai.OpenAI) -> None:
    for seed in range(3):
        c = client.completions.create(model="m", prompt=f"trip {seed}", max_tokens=200, seed=seed,
                                      extra_body={"response_format": schema_format()})
        jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)
        m = client.chat.completions.create(model="m", messages=CHAT, max_tokens=200, seed=seed,
                                           response_format=schema_format())  # type: ignore[arg-type]
        jsonschema.validate(json.loads(m.choices[0].message.content or ""), SCHEMA)
        parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model="m", messages=CHAT, max_tokens=200, seed=seed, stream=True,
            response_format=schema_format()) if ch.choices]  # type: ignore[arg-type]
        jsonschema.validate(json.loads("".join(parts)), SCHEMA)


def test_regex_choice_and_the_older_guided_names(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt="code", max_tokens=20, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    for body in ({"structured_outputs": {"choice": ["red", "green"]}}, {"guided_choice": ["red", "green"]}):
        r = client.completions.create(model="m", prompt="colour", max_tokens=20, seed=2, extra_body=body)
        assert r.choices[0].text in ("red", "green")


def test_a_schema_the_grammar_library_refuses_is_a_400_with_its_reason(served: tuple[str, Any]) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                         "properties": {"a": {"type": 7}}}}}
    r = httpx.post(served[0] + "/v1/chat/completions", json={"messages": CHAT, "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "json_schema" in r.json()["error"]["message"]
    two = {"messages": CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"}
    assert httpx.post(served[0] + "/v1/chat/completions", json=two).status_code == 400


def test_a_named_tool_call_and_a_required_one_in_openais_shape(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=200, seed=3, tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "forecast"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tc] = choice.message.tool_calls or []
    assert tc.function.name == "forecast"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(tc.function.arguments), SCHEMA)  # type: ignore[union-attr]
    for seed in range(4):
        req = client.chat.completions.create(
            model="m", messages=CHAT, max_tokens=200, seed=seed, tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required")
        [tc] = req.choices[0].message.tool_calls or []
        spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]
        fn = tc.function  # type: ignore[union-attr]
        jsonschema.validate(json.loads(fn.arguments), spec[fn.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "alarm"}}])
def test_a_streamed_tool_call_reassembles_to_the_whole_one(client: openai.OpenAI, tool_choice: Any) -> None:
    kw: dict[str, Any] = {"model": "m", "messages": CHAT, "max_tokens": 200, "seed": 5, "tools": TOOLS,
                          "tool_choice": tool_choice}
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]  # type: ignore[index]
    names, args, reasons = [], [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            names += [d.function.name] if d.function and d.function.name else []
            args.append(d.function.arguments or "" if d.function else "")
        reasons.append(chunk.choices[0].finish_reason)
    assert names == [whole.function.name] and "".join(args) == whole.function.arguments
    assert reasons[-1] == "tool_calls"


def test_logprobs_equal_hfs_log_softmax_on_the_same_weights(client: openai.OpenAI,
                                                            served: tuple[str, Any]) -> None:
    engine = served[1]
    r = client.completions.create(model="m", prompt="The library", max_tokens=12, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 12
    assert all(len(t) <= 3 for t in lp.top_logprobs or [])
    prompt = engine.prompts.encode("The library")
    with torch.inference_mode():
        out = engine.hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        logits = engine.hf_model(torch.tensor([prompt + out])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    assert lp.tokens == [engine.prompts.tokenizer.decode([t]) for t in out]  # HF's greedy tokens
    got = torch.tensor(lp.token_logprobs)
    want = torch.tensor([float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(out)])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    top = [float(v) for v in torch.topk(ref[len(prompt) - 1], 3).values]
    assert sorted((lp.top_logprobs or [{}])[0].values(), reverse=True) == pytest.approx(top, abs=1e-4)
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    streamed = [ch.choices[0].logprobs for ch in client.completions.create(
        model="m", prompt="The library", max_tokens=12, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].logprobs]
    assert [v for s in streamed for v in s.token_logprobs or []] == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_n_samples_each_seeded_reproducible_and_streamed_by_index(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "m", "prompt": ["alpha beta", "gamma"], "max_tokens": 8, "n": 3,
                          "seed": 11, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == list(range(6))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices[:3]}) > 1  # the samples differ
    assert a.usage is not None and a.usage.completion_tokens == 6 * 8
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, n=4, seed=2,
                                                stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    whole = client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, n=4, seed=2)
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_best_of_returns_the_most_likely_samples(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt="x", max_tokens=6, n=1, best_of=4, seed=3, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.usage is not None and r.usage.completion_tokens == 4 * 6
    alone = client.completions.create(model="m", prompt="x", max_tokens=6, n=4, seed=3, logprobs=0,
                                      extra_body={"ignore_eos": True})
    totals = [sum(c.logprobs.token_logprobs or []) for c in alone.choices]  # type: ignore[union-attr]
    kept = r.choices[0].logprobs.token_logprobs or []  # type: ignore[union-attr]
    assert sum(kept) == pytest.approx(max(totals), abs=1e-5)


def test_penalties_logit_bias_and_min_tokens_change_the_answer(client: openai.OpenAI) -> None:
    base: dict[str, Any] = {"model": "m", "prompt": "the the the", "max_tokens": 24, "temperature": 0}
    plain = client.completions.create(**base, extra_body={"ignore_eos": True})
    ids = plain.choices[0].logprobs
    penal = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0, logprobs=0,
                                      extra_body={"ignore_eos": True})
    assert ids is None and penal.choices[0].logprobs is not None
    toks = penal.choices[0].logprobs.tokens or []
    assert len(set(toks)) > len(toks) // 2  # every repeat costs 2 per use + 2: few tokens repeat
    forced = client.completions.create(**base, logit_bias={"300": 100}, logprobs=0)
    forced_tokens = forced.choices[0].logprobs.tokens or []  # type: ignore[union-attr]
    assert len(forced_tokens) == 24 and set(forced_tokens) == {forced_tokens[0]}
    eos_first = client.completions.create(model="m", prompt="x", max_tokens=8, temperature=0,
                                          logit_bias={"2": 100}, extra_body={"min_tokens": 5})
    assert eos_first.usage is not None and eos_first.usage.completion_tokens == 6  # EOS right after the 5
    assert eos_first.choices[0].finish_reason == "stop"


def test_a_constraint_past_its_size_limit_is_a_400_before_it_is_compiled(served: tuple[str, Any]) -> None:
    huge = {"structured_outputs": {"regex": "a" * 70_000}}
    r = httpx.post(served[0] + "/v1/completions", json={"prompt": "x", **huge})
    assert r.status_code == 400 and r.json()["error"]["code"] == "constraint_too_long"


def test_the_fair_order_serves_a_light_tenant_ahead_of_a_flood_over_http() -> None:
    """``--scheduling-policy fair`` on the real routes: the tenant is the request's X-Client-Id (no keys
    file), one sequence runs at a time, a light tenant's request arriving behind six of a flood's goes
    next, not last."""
    import asyncio

    engine = build_llm_engine(None, num_hidden_layers=2, hidden_size=128, intermediate_size=344,
                              num_attention_heads=4, num_key_value_heads=2, num_kv_blocks=64, block_size=16,
                              max_num_seqs=1, max_model_len=256, policy="fair", model_name="m")
    done: list[str] = []

    async def one(http: httpx.AsyncClient, who: str, delay: float) -> None:
        await asyncio.sleep(delay)
        r = await http.post("/v1/completions", headers={"X-Client-Id": who},
                            json={"prompt": "x", "max_tokens": 24, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200
        done.append(who)

    async def run(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            await asyncio.gather(*(one(http, "flood", 0.0) for _ in range(6)), one(http, "light", 0.05))

    try:
        with live_server(NoopExecutor(), engines=[llm_routes(engine, "m")]) as srv:
            asyncio.run(run(srv.url))
            view = {row["tenant"]: row for row in httpx.get(srv.url + "/v1/tenants").json()["llm"]["m"]}
    finally:
        engine.shutdown()
    assert done.index("light") <= 2, done  # the running flood request, maybe one more, then light
    # GET /v1/tenants shows the fair order's counters: the flood was charged six requests, light one
    assert view["flood"]["requests"] == 6 and view["light"]["requests"] == 1
    assert view["flood"]["counter"] > view["light"]["counter"] > 0, view
    assert view["flood"]["waiting"] == view["light"]["waiting"] == 0
