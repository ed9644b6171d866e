"""The sampler's rules against their references: logprobs = HF's log_softmax, penalties = HF's and
OpenAI's rules, ``logit_bias``, ``min_tokens``, and structured-output masks that only admit what the
grammar allows (on the seeded random model: grammar enforcement needs no trained model)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from batchpilot.core.llm.sequence import SamplingParams, Sequence, StructuredOutput
from batchpilot.models.llm.grammar import GrammarRefused, grammars_for
from batchpilot.models.llm.sampler import Sampler
from batchpilot.models.llm.tokenizer import EOS_ID, build_tokenizer, make_decode

VOCAB = 4096


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer(VOCAB)


def sampler(tok: Any) -> Sampler:
    s = Sampler()
    s.bind(tok, VOCAB, (EOS_ID,))
    return s


def test_logprobs_are_the_raw_log_softmax_with_the_top_k_best_first(tok: Any) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    seqs = [Sequence(i, [5], SamplingParams(temperature=0, logprobs=k, presence_penalty=1.0))
            for i, k in enumerate((0, 3, None))]
    out = sampler(tok).choose(logits, seqs)
    ref = torch.log_softmax(logits, dim=-1)
    for i, c in enumerate(out[:2]):
        assert c.token == int(logits[i].argmax())
        assert c.logprob == pytest.approx(float(ref[i, c.token]), abs=1e-5)
    assert out[0].top == ()
    ids, vals = zip(*out[1].top, strict=True)
    assert list(ids) == torch.topk(ref[1], 3).indices.tolist()
    assert list(vals) == pytest.approx(torch.topk(ref[1], 3).values.tolist(), abs=1e-5)
    assert out[2].logprob is None


def test_repetition_penalty_is_hfs_and_presence_frequency_are_openais(tok: Any) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    prompt, outputs = [10, 11, 12], [12, 40, 40, 41]
    seq = Sequence(0, prompt, SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.5,
                                             presence_penalty=0.25))
    seq.output_token_ids = list(outputs)
    got = sampler(tok)._processed(logits, [seq])
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + outputs]), logits.clone())
    for t, n in {12: 1, 40: 2, 41: 1}.items():
        want[0, t] -= 0.5 * n + 0.25
    assert torch.allclose(got, want, atol=1e-5)


def test_logit_bias_and_min_tokens(tok: Any) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS_ID] = 10.0
    seq = Sequence(0, [5], SamplingParams(temperature=0, min_tokens=2, logit_bias=((77, 5.0),)))
    assert sampler(tok).choose(logits, [seq])[0].token == 77  # EOS held back, the bias wins
    seq.output_token_ids = [1, 2]
    assert sampler(tok).choose(logits, [seq])[0].token == EOS_ID  # two tokens out: EOS may come


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}


def generate(s: Sampler, c: StructuredOutput, seed: int, steps: int = 80) -> str:
    """Tokens from random logits under the constraint until EOS: the mask alone must keep it valid."""
    seq = Sequence(seed, [5], SamplingParams(temperature=1.0, seed=seed, max_tokens=steps, structured=c))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = torch.randn(1, VOCAB, generator=g) * 5
        token = s.choose(logits, [seq])[0].token
        if token == EOS_ID:
            break
        seq.output_token_ids.append(token)
    else:
        pytest.fail(f"no EOS within {steps} tokens: {seq.output_token_ids}")
    s.forget(seq.seq_id)
    return make_decode(build_tokenizer(VOCAB))(seq.output_token_ids)


def test_masks_keep_random_logits_inside_a_json_schema_a_regex_and_a_choice(tok: Any) -> None:
    s = sampler(tok)
    for seed in range(6):
        text = generate(s, StructuredOutput("json_schema", json.dumps(SCHEMA)), seed)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", generate(s, StructuredOutput("regex", "[0-9]{3}-[a-c]{2}"),
                                                             seed))
        choice = StructuredOutput("choice", '["yes", "no", "maybe"]')
        assert generate(s, choice, seed) in ("yes", "no", "maybe")
        grammar = StructuredOutput("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?')
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", generate(s, grammar, seed))



def test_json_object_starts_an_object(tok: Any) -> None:
    params = SamplingParams(temperature=1.0, seed=3, structured=StructuredOutput("json_object"))
    seq = Sequence(0, [5], params)
    first = sampler(tok).choose(torch.randn(1, VOCAB) * 5, [seq])[0].token
    assert make_decode(tok)([first]).startswith("{")


def test_a_matcher_made_late_replays_the_outputs_so_far(tok: Any) -> None:
    s = sampler(tok)
    c = StructuredOutput("regex", "abc[0-9]")
    seq = Sequence(0, [5], SamplingParams(temperature=0, structured=c))
    seq.output_token_ids = tok("abc", add_special_tokens=False)["input_ids"]
    token = s.choose(torch.zeros(1, VOCAB), [seq])[0].token
    assert make_decode(tok)([token]) in list("0123456789")


@pytest.mark.parametrize(("kind", "spec"), [("json_schema", "{not json"), ("regex", "(unclosed"),
                                            ("grammar", "root ::= undefined_rule"), ("choice", "[]")])
def test_a_constraint_the_library_refuses_says_why(tok: Any, kind: str, spec: str) -> None:
    with pytest.raises(GrammarRefused, match=kind):
        grammars_for(tok, VOCAB, (EOS_ID,)).compile(StructuredOutput(kind, spec))  # type: ignore[arg-type]


def test_a_grammar_never_lets_a_surrogates_bytes_or_a_control_character_through(tok: Any) -> None:
    """xgrammar's UTF-8 decoding takes a surrogate's encoding (ED A0-BF ..) that every decoder turns into
    U+FFFD, and its bounded JSON string takes raw control characters: the sampler's masks do not."""
    g = grammars_for(tok, VOCAB, (EOS_ID,))
    vocab = g.info.decoded_vocab
    ed, cont = vocab.index(b"\xed"), vocab.index(b"\xad")
    ctrl = next(i for i, b in enumerate(vocab) if b == b"\x01")
    c = StructuredOutput("json_schema", json.dumps({"type": "string", "maxLength": 5}))
    seq = Sequence(0, [5], SamplingParams(temperature=0, structured=c))
    seq.output_token_ids = [vocab.index(b'"')]
    logits = torch.zeros(1, VOCAB)
    logits[0, ctrl] = 50.0
    logits[0, ed] = 40.0
    s = sampler(tok)
    assert s.choose(logits, [seq])[0].token == ed  # the control character is masked, ED is not
    seq.output_token_ids.append(ed)
    logits[0, cont] = 60.0
    after = s.choose(logits, [seq])[0].token
    assert after != cont and 0x80 <= vocab[after][0] <= 0x9F  # ED then A0-BF would be a surrogate
