"""Sequence state and sampling params: the counters the scheduler relies on."""

from __future__ import annotations

import pytest

from batchpilot.core.llm.sequence import SamplingParams, SeqStatus, Sequence


def make_seq(prompt_len: int = 5, max_tokens: int = 4, **kw: object) -> Sequence:
    return Sequence(seq_id=0, prompt_token_ids=list(range(10, 10 + prompt_len)),
                    params=SamplingParams(max_tokens=max_tokens), **kw)  # type: ignore[arg-type]


def test_counts_follow_computed_tokens() -> None:
    seq = make_seq(prompt_len=5)
    assert seq.status is SeqStatus.WAITING
    assert (seq.num_tokens, seq.num_pending_tokens) == (5, 5)
    seq.num_computed_tokens = 5
    seq.output_token_ids.append(99)
    assert (seq.num_tokens, seq.num_pending_tokens, seq.num_output_tokens) == (6, 1, 1)
    assert seq.max_total_tokens == 5 + 4 - 1


@pytest.mark.parametrize(("start", "stop"), [(0, 3), (2, 5), (3, 7), (5, 7), (0, 7)])
def test_token_ids_slices_across_prompt_and_output(start: int, stop: int) -> None:
    seq = make_seq(prompt_len=5)
    seq.output_token_ids.extend([100, 101])
    assert seq.token_ids(start, stop) == seq.all_token_ids[start:stop]


def test_empty_prompt_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        Sequence(seq_id=1, prompt_token_ids=[])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
     ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)
def test_sampling_params_are_validated(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_greedy_detection() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
