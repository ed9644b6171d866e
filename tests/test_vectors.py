"""Properties of ``batchpilot.server.vectors`` (hypothesis), against references written here with
Python scalars (not the module's helpers):

* truncation keeps the prefix's direction, re-normalises to unit norm (a zero prefix stays zero),
  leaves the vectors alone for None / the full size, and refuses dimensions outside [1, d];
* every embedding type equals the reference bytewise, in its range, in its dtype and shape;
* int8 / uint8 of a unit vector reconstruct each coordinate within half a step;
* ubinary unpacks to ``x > 0`` with zero pad bits; binary is ubinary - 128 bytewise;
* base64 decodes to the same bytes; orjson writes int types as JSON integers;
* a row's result does not depend on the other rows of the request;
* int8 cosine similarity of random unit vectors stays within 0.02 of the float cosine (d <= 1024).
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batchpilot.server import vectors as V

WIRE_DTYPE: dict[str, np.dtype[Any]] = {
    "float": np.dtype("<f4"), "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
    "binary": np.dtype(np.int8), "ubinary": np.dtype(np.uint8)}

# any float32 values, out of [-1, 1] too, with the exact edges and zeros likely
values = st.one_of(st.floats(-3, 3, width=32), st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5 / 127]))


@st.composite
def matrices(draw: Any, max_n: int = 6, max_d: int = 40) -> np.ndarray:
    n, d = draw(st.integers(1, max_n)), draw(st.integers(1, max_d))
    return np.asarray(draw(hnp.arrays(np.float32, (n, d), elements=values)))


@st.composite
def unit_vectors(draw: Any, max_n: int = 8, min_d: int = 1, max_d: int = 1024) -> np.ndarray:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n, d = draw(st.integers(1, max_n)), draw(st.integers(min_d, max_d))
    x = rng.standard_normal((n, d))
    return np.asarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)


def ref_quantize(x: np.ndarray, kind: str) -> list[list[int]] | list[list[float]]:
    out: list[Any] = []
    for row in x.tolist():
        clipped = [max(-1.0, min(1.0, v)) for v in row]
        if kind == "float":
            out.append(row)
        elif kind == "int8":
            out.append([round(v * 127) for v in clipped])
        elif kind == "uint8":
            out.append([round((v + 1) * 127.5) for v in clipped])
        else:
            bits = [1 if v > 0 else 0 for v in row]
            bits += [0] * (-len(bits) % 8)
            packed = [sum(b << (7 - j) for j, b in enumerate(bits[k:k + 8])) for k in range(0, len(bits), 8)]
            out.append(packed if kind == "ubinary" else [b - 128 for b in packed])
    return out


def ref_truncate(x: np.ndarray, dims: int, normalize: bool) -> np.ndarray:
    rows = []
    for row in x.tolist():
        prefix = row[:dims]
        norm = math.sqrt(sum(v * v for v in prefix))
        rows.append([v / norm for v in prefix] if normalize and norm > 0 else prefix)
    return np.array(rows, dtype=np.float64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.asarray((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))


# --- truncate -------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(matrices(), st.data(), st.booleans())
def test_truncate_keeps_prefix_direction_and_unit_norm(x: np.ndarray, data: Any, normalize: bool) -> None:
    d = x.shape[1]
    dims = data.draw(st.integers(1, d))
    out = V.truncate(x, dims, normalize)
    assert out.shape == (x.shape[0], dims) and out.dtype == np.float32 and out.flags.c_contiguous
    if dims == d:
        np.testing.assert_array_equal(out, x)  # the full size is no truncation: no re-normalisation
        return
    ref = ref_truncate(x, dims, normalize)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-30)
    prefix = x[:, :dims].astype(np.float64)
    zero = ~prefix.any(axis=1)
    assert not out[zero].any()  # a zero prefix stays zero, never NaN
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(out[~zero].astype(np.float64), axis=1), 1.0, atol=1e-6)
        np.testing.assert_allclose(cosines(out[~zero], prefix[~zero]), 1.0, atol=1e-6)
    else:
        np.testing.assert_array_equal(out, x[:, :dims])


@given(matrices(), st.booleans())
def test_truncate_none_or_full_size_is_unchanged(x: np.ndarray, normalize: bool) -> None:
    for dims in (None, x.shape[1]):
        np.testing.assert_array_equal(V.truncate(x, dims, normalize), x)


def test_truncate_zero_vector_and_exact_values() -> None:
    x = np.array([[3.0, 4.0, 9.0], [0.0, 0.0, 5.0]], dtype=np.float32)
    np.testing.assert_allclose(V.truncate(x, 2, True), [[0.6, 0.8], [0.0, 0.0]], rtol=1e-7)
    np.testing.assert_array_equal(V.truncate(x, 2, False), [[3.0, 4.0], [0.0, 0.0]])


@pytest.mark.parametrize("dims", [0, -1, 9, 100])
def test_truncate_refuses_dimensions_outside_1_to_d(dims: int) -> None:
    x = np.ones((2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match=f"dimensions must be at (least 1|most the model's 8); got {dims}"):
        V.truncate(x, dims, True)


@pytest.mark.parametrize("dims", [True, 2.0, "4"])
def test_truncate_refuses_non_integer_dimensions(dims: Any) -> None:
    with pytest.raises(ValueError, match="dimensions must be an integer"):
        V.truncate(np.ones((1, 8), dtype=np.float32), dims, True)


# --- quantize -------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(matrices(), st.sampled_from(V.EMBEDDING_TYPES))
def test_quantize_matches_reference_in_range_dtype_and_shape(x: np.ndarray, kind: str) -> None:
    q = V.quantize(x, kind)
    assert q.dtype == WIRE_DTYPE[kind] and q.flags.c_contiguous
    assert q.shape == (x.shape[0], V.output_dim(x.shape[1], kind))
    assert q.tolist() == ref_quantize(x, kind)
    lo, hi = {"float": (-np.inf, np.inf), "int8": (-127, 127), "uint8": (0, 255),
              "binary": (-128, 127), "ubinary": (0, 255)}[kind]
    assert q.size == 0 or (q.min() >= lo and q.max() <= hi)


def test_quantize_edges_and_clipping() -> None:
    # float32 inputs tie only at x = +-0.5 (int8: 127x = +-63.5) and x = 0 (uint8: 127.5)
    x = np.array([[1.0, -1.0, 0.0, 2.0, -5.0, 0.5, -0.5, 0.25]], dtype=np.float32)
    assert V.quantize(x, "int8").tolist() == [[127, -127, 0, 127, -127, 64, -64, 32]]
    assert V.quantize(x, "uint8").tolist() == [[255, 0, 128, 255, 0, 191, 64, 159]]
    assert V.quantize(x[:, :7], "ubinary").tolist() == [[0b10010100]]  # 7 coordinates, a zero pad bit
    assert V.quantize(x[:, :7], "binary").tolist() == [[0b10010100 - 128]]


@settings(max_examples=150, deadline=None)
@given(unit_vectors(max_d=256))
def test_int8_and_uint8_reconstruct_unit_vectors_within_half_a_step(x: np.ndarray) -> None:
    x64 = x.astype(np.float64)
    q8 = V.quantize(x, "int8").astype(np.float64)
    assert np.abs(q8 / 127 - x64).max() <= 0.5 / 127 + 1e-12
    qu = V.quantize(x, "uint8").astype(np.float64)
    assert np.abs(qu / 127.5 - 1 - x64).max() <= 0.5 / 127.5 + 1e-12


@settings(max_examples=150, deadline=None)
@given(matrices(max_d=70))
def test_ubinary_unpacks_to_signs_with_zero_pad_bits(x: np.ndarray) -> None:
    d = x.shape[1]
    bits = np.unpackbits(V.quantize(x, "ubinary"), axis=-1)
    assert bits.shape[1] == 8 * math.ceil(d / 8)
    np.testing.assert_array_equal(bits[:, :d], x > 0)
    assert not bits[:, d:].any()


@settings(max_examples=150, deadline=None)
@given(matrices(max_d=70))
def test_binary_is_ubinary_minus_128_bytewise(x: np.ndarray) -> None:
    b, ub = V.quantize(x, "binary"), V.quantize(x, "ubinary")
    np.testing.assert_array_equal(b.astype(np.int16), ub.astype(np.int16) - 128)
    np.testing.assert_array_equal(b.view(np.uint8) ^ 0x80, ub)  # the same thing: the top bit flipped


@settings(max_examples=100, deadline=None)
@given(matrices(), st.sampled_from(V.EMBEDDING_TYPES), st.data())
def test_a_rows_result_does_not_depend_on_the_other_rows(x: np.ndarray, kind: str, data: Any) -> None:
    others = data.draw(hnp.arrays(np.float32, x.shape, elements=values))
    dims = data.draw(st.integers(1, x.shape[1]))
    i = data.draw(st.integers(0, x.shape[0] - 1))
    mixed = others.copy()
    mixed[i] = x[i]
    alone = V.quantize(V.truncate(x[i:i + 1], dims, True), kind)[0]
    for batch in (x, mixed):
        np.testing.assert_array_equal(V.quantize(V.truncate(batch, dims, True), kind)[i], alone)


# Rounding errors e = q/127 - x are about uniform on [-0.5/127, 0.5/127] (variance s2 = 1/(12 * 127^2)),
# independent of x. For unit vectors a, b with cosine c the int8 cosine then differs by about
#   -c * d * s2   (the errors lengthen both vectors off their direction: d * s2 = 0.0053 at d = 1024)
#   + noise of standard deviation sqrt(2 * (1 - c^2) * s2) <= 0.0032, whatever d.
# So for d <= 1024 the difference exceeds 0.02 only past 4.5 standard deviations of the noise at the
# worst c, and the largest seen over many random pairs is about 0.012. The bias grows with d: near
# c = 0.9 it reaches 0.02 around d = 4096. (The worst case over adversarial vectors is only the weak
# 2 * asin(sqrt(d) / 254), the angle each vector can move.)
@settings(max_examples=100, deadline=None)
@given(unit_vectors(max_n=32, min_d=8), st.sampled_from([0.0, 0.5, 0.9, 0.99]), st.integers(0, 2**32 - 1))
def test_int8_cosine_of_random_unit_vectors_within_002(a: np.ndarray, rho: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(a.shape)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    b = rho * a.astype(np.float64) + math.sqrt(1 - rho**2) * noise
    b = (b / np.linalg.norm(b, axis=1, keepdims=True)).astype(np.float32)
    exact = cosines(a, b)
    quantised = cosines(V.quantize(a, "int8"), V.quantize(b, "int8"))
    assert np.abs(quantised - exact).max() <= 0.02


# --- encode / output_dim --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(matrices(), st.sampled_from(V.EMBEDDING_TYPES))
def test_base64_decodes_to_the_same_bytes(x: np.ndarray, kind: str) -> None:
    for row in V.quantize(x, kind):
        text = V.encode(row, kind, "base64")
        assert isinstance(text, str)
        raw = base64.b64decode(text, validate=True)
        decoded = np.frombuffer(raw, dtype=WIRE_DTYPE[kind])
        assert decoded.size == V.output_dim(x.shape[1], kind)
        np.testing.assert_array_equal(decoded, row)


@settings(max_examples=150, deadline=None)
@given(matrices(), st.sampled_from(V.EMBEDDING_TYPES))
def test_orjson_writes_int_types_as_json_integers(x: np.ndarray, kind: str) -> None:
    q = V.quantize(x, kind)
    data = [{"embedding": V.encode(row, kind, "float"), "index": i} for i, row in enumerate(q)]
    parsed = json.loads(orjson.dumps({"data": data}, option=orjson.OPT_SERIALIZE_NUMPY))
    for row, item in zip(q, parsed["data"], strict=True):
        emb = item["embedding"]
        assert len(emb) == V.output_dim(x.shape[1], kind)
        if kind == "float":
            assert all(isinstance(v, float) for v in emb)
            np.testing.assert_array_equal(np.array(emb, dtype=np.float32), row)
        else:
            assert all(isinstance(v, int) and not isinstance(v, bool) for v in emb)
            assert emb == row.tolist()


def test_encode_float_format_is_a_contiguous_array_of_the_row() -> None:
    x = np.arange(24, dtype=np.float32).reshape(4, 6) / 24
    column_major = np.asfortranarray(x)
    out = V.encode(column_major[1], "float", "float")
    assert isinstance(out, np.ndarray) and out.flags.c_contiguous and out.dtype == np.float32
    np.testing.assert_array_equal(out, x[1])
    orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)


@pytest.mark.parametrize(("d", "kind", "want"), [(384, "float", 384), (384, "int8", 384),
                                                 (384, "uint8", 384), (384, "binary", 48),
                                                 (384, "ubinary", 48), (1, "binary", 1), (9, "ubinary", 2),
                                                 (0, "ubinary", 0)])
def test_output_dim(d: int, kind: str, want: int) -> None:
    assert V.output_dim(d, kind) == want


def test_bad_types_formats_and_values() -> None:
    x = np.zeros((1, 8), dtype=np.float32)
    for call in (lambda: V.quantize(x, "int4"), lambda: V.encode(x[0], "float16", "float"),
                 lambda: V.output_dim(8, "bits")):
        with pytest.raises(ValueError, match="embedding_type must be one of float, int8, uint8, binary"):
            call()
    with pytest.raises(ValueError, match="encoding_format must be one of float, base64"):
        V.encode(x[0], "float", "hex")
    with pytest.raises(ValueError, match="a int8 row must be int8; got float32"):
        V.encode(x[0], "int8", "float")
    with pytest.raises(ValueError, match="d must be >= 0"):
        V.output_dim(-1, "float")
    for kind in ("int8", "uint8"):
        with pytest.raises(ValueError, match="needs finite values"):
            V.quantize(np.array([[0.1, np.nan]], dtype=np.float32), kind)


def test_binary_types_match_sentence_transformers() -> None:
    quantization = pytest.importorskip("sentence_transformers.util.quantization")
    rng = np.random.default_rng(7)
    for d in (8, 13, 384):
        x = rng.standard_normal((5, d)).astype(np.float32)
        for kind in ("binary", "ubinary"):
            theirs = quantization.quantize_embeddings(x, precision=kind)
            assert theirs.dtype == V.quantize(x, kind).dtype
            np.testing.assert_array_equal(V.quantize(x, kind), theirs)
        np.testing.assert_array_equal(V.quantize(x, "float"),
                                      quantization.quantize_embeddings(x, precision="float32"))
