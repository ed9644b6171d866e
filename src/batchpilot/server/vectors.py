"""The output side of embeddings: matryoshka truncation and quantised embedding types.

Pure NumPy, no state. A request's vectors pass ``truncate`` (the ``dimensions`` field), then
``quantize`` (the ``embedding_type`` field), then ``encode`` per row (the ``encoding_format`` field).

Contracts and ranges:

* ``truncate(vectors, dimensions, normalize)``: ``vectors`` is float ``[..., d]``. ``dimensions`` None
  or ``d``: the input unchanged. ``1 <= dimensions < d``: the first ``dimensions`` coordinates of every
  vector (matryoshka, as sentence-transformers' ``truncate_dim``), re-normalised to unit L2 norm when
  ``normalize`` (the model normalises its output); a zero prefix stays zero. Anything else (``< 1`` or
  ``> d``) is a ValueError. The result is C-contiguous float32.
* ``quantize(vectors, embedding_type)``: ``vectors`` is float ``[..., d]``; one of ``EMBEDDING_TYPES``:

  - ``float``: the float32 input unchanged;
  - ``int8``: ``rint(clip(x, -1, 1) * 127)`` as int8, in ``[-127, 127]``; ``x ~= q / 127`` within
    ``0.5 / 127``;
  - ``uint8``: ``rint((clip(x, -1, 1) + 1) * 127.5)`` as uint8, in ``[0, 255]``; ``x ~= q / 127.5 - 1``
    within ``0.5 / 127.5``;
  - ``ubinary``: ``np.packbits(x > 0, axis=-1)``, ``ceil(d / 8)`` uint8 bytes, bit order big-endian
    within a byte (coordinate ``8k`` is the top bit of byte ``k``); when ``d`` is not a multiple of 8 the
    last byte's low bits are zero padding;
  - ``binary``: the ``ubinary`` bytes minus 128, as int8 in ``[-128, 127]``.

  ``binary``/``ubinary`` are sentence-transformers' ``quantize_embeddings`` layouts exactly. The
  ``int8``/``uint8`` ranges are fixed: every coordinate of a unit vector lies in ``[-1, 1]``, values
  outside are clipped, and no vector's quantisation depends on the other vectors of the request
  (sentence-transformers calibrates its ranges on the batch, so there a vector's bytes depend on its
  batch mates). Rounding is to nearest, computed in float64 (exact for float32 inputs, whose only
  ties are ``x = +-0.5`` for int8, to ``+-64``, and ``x = 0`` for uint8, to 128). ``int8`` and ``uint8``
  need finite inputs (ValueError otherwise). Unknown types are a ValueError.
* ``encode(row, embedding_type, encoding_format)``: the JSON ``embedding`` field for one quantised row:
  ``float`` format, the array itself, C-contiguous (orjson with ``OPT_SERIALIZE_NUMPY`` writes float32 as
  numbers and int8/uint8 as integers); ``base64`` format, the base64 text of the raw bytes (little-endian
  float32 for ``float``, the int8/uint8 bytes, one per value, for the others).
* ``output_dim(d, embedding_type)``: how many values a client gets per ``d``-dimensional vector (JSON
  numbers in ``float`` format, base64-encoded elements in ``base64``): ``d``, or ``ceil(d / 8)`` for
  ``binary``/``ubinary``.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
import numpy.typing as npt

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary"]
EncodingFormat = Literal["float", "base64"]

EMBEDDING_TYPES: tuple[EmbeddingType, ...] = ("float", "int8", "uint8", "binary", "ubinary")
ENCODING_FORMATS: tuple[EncodingFormat, ...] = ("float", "base64")

_DTYPES: dict[str, type[np.generic]] = {"float": np.float32, "int8": np.int8, "uint8": np.uint8,
                                        "binary": np.int8, "ubinary": np.uint8}


def _check_type(embedding_type: str) -> None:
    if embedding_type not in _DTYPES:
        raise ValueError(f"embedding_type must be one of {', '.join(EMBEDDING_TYPES)}; "
                         f"got {embedding_type!r}")


def _last_dim(vectors: npt.NDArray[np.generic]) -> int:
    if vectors.ndim < 1:
        raise ValueError("vectors must have at least one axis (the embedding dimension)")
    return int(vectors.shape[-1])


def truncate(vectors: npt.NDArray[np.floating], dimensions: int | None,
             normalize: bool) -> npt.NDArray[np.float32]:
    """The first ``dimensions`` coordinates of each vector, re-normalised to unit L2 norm when
    ``normalize`` (a zero prefix stays zero). None or the full size: the vectors unchanged (as
    C-contiguous float32). ValueError unless ``1 <= dimensions <= d``."""
    d = _last_dim(vectors)
    if dimensions is None or dimensions == d:
        return np.ascontiguousarray(vectors, dtype=np.float32)
    if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)):
        raise ValueError(f"dimensions must be an integer; got {dimensions!r}")
    if dimensions < 1:
        raise ValueError(f"dimensions must be at least 1; got {dimensions}")
    if dimensions > d:
        raise ValueError(f"dimensions must be at most the model's {d}; got {dimensions}")
    prefix = vectors[..., :dimensions].astype(np.float64)
    if normalize:
        norms = np.linalg.norm(prefix, axis=-1, keepdims=True)
        prefix /= np.where(norms > 0, norms, 1.0)
    return np.ascontiguousarray(prefix, dtype=np.float32)


def quantize(vectors: npt.NDArray[np.floating],
             embedding_type: EmbeddingType | str) -> npt.NDArray[np.generic]:
    """``vectors`` (float ``[..., d]``) in ``embedding_type``: float32 ``[..., d]``, int8/uint8
    ``[..., d]`` on the fixed ranges of the module docstring, or ``[..., ceil(d/8)]`` packed sign bits
    (binary int8, ubinary uint8). Each vector's result depends on that vector alone."""
    _check_type(embedding_type)
    _last_dim(vectors)
    if embedding_type == "float":
        return np.ascontiguousarray(vectors, dtype=np.float32)
    if embedding_type in ("binary", "ubinary"):
        packed = np.packbits(np.asarray(vectors) > 0, axis=-1)
        if embedding_type == "ubinary":
            return packed
        return (packed.astype(np.int16) - 128).astype(np.int8)
    x = np.asarray(vectors, dtype=np.float64)
    if not np.isfinite(x).all():
        raise ValueError(f"{embedding_type} quantisation needs finite values")
    x = np.clip(x, -1.0, 1.0)
    if embedding_type == "int8":
        return np.rint(x * 127.0).astype(np.int8)
    return np.rint((x + 1.0) * 127.5).astype(np.uint8)


def encode(row: npt.NDArray[np.generic], embedding_type: EmbeddingType | str,
           encoding_format: EncodingFormat | str) -> npt.NDArray[np.generic] | str:
    """One quantised row as the JSON ``embedding`` field: the C-contiguous array (``float`` format;
    orjson's ``OPT_SERIALIZE_NUMPY`` writes it) or base64 of its raw bytes (``base64`` format:
    little-endian float32, or one byte per int8/uint8 value). ValueError for an unknown type or format,
    or a row whose dtype is not the type's."""
    _check_type(embedding_type)
    if encoding_format not in ENCODING_FORMATS:
        raise ValueError(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}; "
                         f"got {encoding_format!r}")
    want = np.dtype(_DTYPES[embedding_type])
    if embedding_type == "float":
        arr = np.ascontiguousarray(row, dtype=np.float32)
    else:
        if np.asarray(row).dtype != want:
            raise ValueError(f"a {embedding_type} row must be {want}; got {np.asarray(row).dtype} "
                             "(quantize it first)")
        arr = np.ascontiguousarray(row)
    if encoding_format == "float":
        return arr
    raw = arr.astype("<f4", copy=False) if embedding_type == "float" else arr
    return base64.b64encode(raw.tobytes()).decode("ascii")


def output_dim(d: int, embedding_type: EmbeddingType | str) -> int:
    """Values per vector a client gets for a ``d``-dimensional vector: ``d``, or ``ceil(d/8)`` packed
    bytes for ``binary``/``ubinary``. ValueError for ``d < 0`` or an unknown type."""
    _check_type(embedding_type)
    if d < 0:
        raise ValueError(f"d must be >= 0; got {d}")
    return -(-d // 8) if embedding_type in ("binary", "ubinary") else d

