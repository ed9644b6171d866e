"""The CUDA paths, on seeded random models (no downloaded weights: a GPU machine may have none).

Run on a GPU machine with ``pytest -m cuda tests/test_cuda.py`` (``benchmarks/gpu_check.sh`` does, with
``PYTHONPATH=src`` and the machine's own torch); without CUDA every test here skips. Only torch,
transformers, tokenizers and numpy are needed: no server stack.

* the encoder in float32, float16 and bfloat16, padded and padding-free (varlen attention), against
  HF's float32 forward on the same weights, and the pinned-memory side-stream copy;
* the LLM model runner's paged decode on CUDA: greedy tokens equal to HF ``generate`` on the same
  weights and device.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from batchpilot.models.seeded import build_word_encoder

# BATCHPILOT_CUDA_TESTS_ON=cpu runs the same tests on the CPU (a dry run of their logic, not of CUDA)
DEVICE = os.environ.get("BATCHPILOT_CUDA_TESTS_ON", "cuda")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                   reason="needs a CUDA device")]

WORDS = [f"w{i}" for i in range(400)]


def texts() -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=n)) for n in (3, 17, 60, 120, 9, 250, 1, 33)]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_word_encoder(tmp_path_factory.mktemp("cuda") / "bert", words=len(WORDS))


@pytest.fixture(scope="module")
def reference(folder: str) -> np.ndarray:
    from batchpilot.models.encoder import EncoderConfig, EncoderExecutor

    cpu = EncoderExecutor(EncoderConfig(model_path=folder, device="cpu", lean_forward=False))
    return cpu.encode(texts())


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_encoder_on_cuda_padded_and_padding_free_match_hf_float32(folder: str, reference: np.ndarray,
                                                                  dtype: str) -> None:
    from batchpilot.models.encoder import EncoderConfig, EncoderExecutor

    if DEVICE == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    gpu = EncoderExecutor(EncoderConfig(model_path=folder, device=DEVICE, dtype=dtype))  # type: ignore[arg-type]
    floor = 0.99999 if dtype == "float32" else 0.999
    for padding in ("dynamic", "none"):
        got = gpu.encode(texts(), padding=padding)
        assert cosines(got, reference).min() >= floor, (dtype, padding)


def test_cuda_pinned_side_stream_copy(folder: str, reference: np.ndarray) -> None:
    from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, make_batch

    gpu = EncoderExecutor(EncoderConfig(model_path=folder, device=DEVICE))
    prepared = gpu.prepare(make_batch(gpu.tokenize(texts()), "dynamic", gpu.max_length))
    staged = prepared.staged
    assert staged is not None
    if DEVICE == "cuda":  # copy issued on the side stream, event recorded
        assert staged.ready is not None and all(t.is_cuda for t in staged.tensors.values())
    assert cosines(np.stack(gpu.run(prepared)), reference).min() >= 0.99999


def test_llm_paged_decode_on_cuda_is_greedy_identical_to_hf_generate() -> None:
    from batchpilot.core.llm.config import LLMSchedulerConfig
    from batchpilot.core.llm.scheduler import LLMScheduler
    from batchpilot.models.llm.runner import LLMModelRunner
    from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
    from batchpilot.models.seeded import LLMModelConfig
    from llm_greedy import engine_greedy, hf_greedy

    cfg = LLMModelConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.06, seed=1)
    hf: Any = load_hf_llama(None, cfg)
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(7, 4096, (n,), generator=g).tolist() for n in (5, 17, 33, 8, 41, 3)]
    weights = LlamaWeights.from_hf(hf)
    want = hf_greedy(hf.to(DEVICE), prompts, 10, DEVICE)
    config = LLMSchedulerConfig(block_size=8, max_model_len=2048, num_kv_blocks=256,
                                max_num_batched_tokens=64)
    runner = LLMModelRunner(weights, config.num_kv_blocks, config.block_size, device=DEVICE)
    assert engine_greedy(LLMScheduler(config), runner, prompts, 10) == want
