"""Chat prompts from the checkpoint's own chat template, over the real LLM routes (uvicorn on a free
127.0.0.1 port, the ``openai`` client).

Three tiny checkpoints of three families, each with the built-in BPE tokenizer plus the markers its
template names: a Llama with a Llama-3-style template that writes the BOS itself (in
``chat_template.jinja``), a Qwen2 with a ChatML template that writes none (in ``tokenizer_config.json``),
and a Gemma 2 with no template. A chat's prompt tokens are what ``apply_chat_template(...,
tokenize=True)`` gives (one BOS for the Llama-3 style, none for ChatML), checked on the count the server
reports and on the answer: the greedy chat answer equals the greedy completion of those very token ids.
Without a template the built-in format is used, with the tokenizer's BOS in front.
"""

from __future__ import annotations

import copy
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from batchpilot.models.llm.tokenizer import BOS_ID, CHAT_TEMPLATE, build_tokenizer, load_tokenizer
from batchpilot.runtime.llm.build import build_llm_engine
from batchpilot.server.errors import install_error_handlers
from batchpilot.server.llm.routes import make_llm_router

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# (family, template, where the checkpoint keeps it, the markers it adds as special tokens)
CASES = {
    "llama3-jinja": ("llama", LLAMA3, "chat_template.jinja",
                     ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "chatml-config": ("qwen2", CHATML, "tokenizer_config.json", ["<|im_start|>", "<|im_end|>"]),
    "none": ("gemma2", None, None, []),
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
GREEDY: dict[str, Any] = {"model": "m", "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


def save_checkpoint(path: Path, model_type: str, template: str | None, where: str | None,
                    markers: list[str]) -> None:
    """A tiny seeded ``model_type`` and the built-in tokenizer with ``markers`` and ``template``."""
    import transformers

    tok = copy.deepcopy(build_tokenizer(4096))  # the cached one stays as it is
    tok.add_tokens(markers, special_tokens=True)
    tok.chat_template = template
    tok.save_pretrained(path)
    if where == "tokenizer_config.json":  # the older place: the template inside the tokenizer config
        (path / "chat_template.jinja").unlink()
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = template
        cfg_path.write_text(json.dumps(cfg))
    shape = dict(vocab_size=4104, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 initializer_range=0.06, pad_token_id=0, bos_token_id=BOS_ID, eos_token_id=2)
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "gemma2": transformers.Gemma2Config}[model_type]
    extra = {"head_dim": 32, "query_pre_attn_scalar": 32} if model_type == "gemma2" else {}
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config_cls(**shape, **extra)).save_pretrained(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, openai.OpenAI, Path]]:
    case = str(request.param)
    path = tmp_path_factory.mktemp(case)
    save_checkpoint(path, *CASES[case])
    engine = build_llm_engine(str(path), num_kv_blocks=64, block_size=16, max_model_len=256, plan_rows=False,
                              model_name="m", tokenizer_threads=1)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(make_llm_router(engine, CollectorRegistry()))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    yield case, client, path
    srv.should_exit = True
    thread.join(10)
    engine.shutdown()


def expected_prompt(case: str, path: Path) -> list[int]:
    """What HF makes of the conversation with the checkpoint's tokenizer: its template's tokens, or the
    built-in format tokenized as a prompt (its BOS first) when it has none."""
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if CASES[case][1] is None:
        assert tok.chat_template is None
        text = tok.apply_chat_template(MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True,
                                       tokenize=False)
        return list(tok(text)["input_ids"])
    return list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_the_chat_prompt_is_the_checkpoints_template_token_for_token(
        served: tuple[str, openai.OpenAI, Path]) -> None:
    case, client, path = served
    want = expected_prompt(case, path)
    bos = {"llama3-jinja": 1, "chatml-config": 0, "none": 1}[case]  # never a second one
    assert want.count(BOS_ID) == bos and (want[0] == BOS_ID) == bool(bos)
    chat = client.chat.completions.create(messages=MESSAGES, **GREEDY)  # type: ignore[call-overload]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(want)
    same = client.completions.create(prompt=want, **GREEDY)  # the very ids, as a completion
    assert same.usage is not None and same.usage.prompt_tokens == len(want)
    assert chat.choices[0].message.content == same.choices[0].text
    assert chat.usage.completion_tokens == 8


def test_the_log_says_which_chat_format_a_checkpoint_gets(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    for case in ("none", "chatml-config"):
        save_checkpoint(tmp_path / case, *CASES[case])
    with caplog.at_level(logging.INFO, logger="batchpilot.models.llm.tokenizer"):
        assert load_tokenizer(tmp_path / "none").chat_template is None
        assert load_tokenizer(tmp_path / "chatml-config").chat_template == CHATML
    assert "none has no chat template; chat prompts use the built-in format" in caplog.text
    assert "chat prompts use the chat template of" in caplog.text
