"""The sampler: top-k / top-p / min-p masks, penalties, seeds that reproduce whatever the batch."""

import math

import pytest
import torch

from kiln.llm.sampling import Sampler, SamplingParams, apply_top_k_top_p_min_p
from kiln.llm.sequence import Sequence


def kept(logits, k=0, p=1.0, m=0.0):
    out = apply_top_k_top_p_min_p(logits[None].clone(), torch.tensor([k]), torch.tensor([p]), torch.tensor([m]))
    return set(torch.nonzero(out[0] > float("-inf")).flatten().tolist())


def test_masks():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()
    assert kept(logits, k=2) == {1, 3}
    assert kept(logits, p=0.7) == {1, 3}  # 0.4 + 0.3 reach 0.7: nothing after is needed
    assert kept(logits, p=0.75) == {1, 3, 4}
    assert kept(logits, m=0.3) == {1, 3, 4}  # >= 0.3 * 0.4 = 0.12
    assert kept(logits, k=1, p=0.01) == {1}
    assert kept(logits, p=1e-6) == {1}  # the most likely token always stays
    assert kept(logits, k=3, m=0.5) == {1, 3}
    assert kept(logits) == set(range(5))


def seq(tokens, **kw):
    return Sequence("r", 0, tokens, SamplingParams(**kw))


def test_greedy_and_seeded_rows_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    s = Sampler()
    a = s(logits[1:2], [seq([1], temperature=0.9, seed=3)])[0]
    rows = [seq([1], temperature=0), seq([1], temperature=0.9, seed=3), seq([1], temperature=1.0), seq([1], top_k=5)]
    toks, _ = s(logits, rows)
    assert toks[0] == logits[0].argmax().item() and toks[1] == a[0]
    # A seeded request's whole stream repeats; an unseeded one draws from the global generator.
    draws = lambda: [s(logits[2:3], [r])[0][0] for r in [seq([1], temperature=1.0, seed=11)] for _ in range(8)]
    assert draws() == draws()


def test_seeded_distribution_follows_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    r = seq([1], temperature=0.5, seed=0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[Sampler()(logits, [r])[0][0]] += 1
    expect = torch.softmax(logits[0] / 0.5, dim=0)
    assert torch.allclose(counts / 3000, expect, atol=0.03)


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5]])
    s = Sampler()
    # repetition over prompt + output divides positive / multiplies negative logits of seen tokens
    assert s(logits, [seq([0], temperature=0, repetition_penalty=2.0)])[0] == [2]
    r = seq([3], temperature=0, frequency_penalty=1.0)
    r.token_ids += [0, 0]  # two generated 0s: 2.0 - 2 = 0 < 1.5
    assert s(logits, [r])[0] == [2]
    r = seq([3], temperature=0, presence_penalty=0.4)
    r.token_ids += [0]  # 1.6 > 1.5 still
    assert s(logits, [r])[0] == [0]


def test_logprobs_are_the_models():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    toks, lps = Sampler()(logits, [seq([1], temperature=0, logprobs=2)])
    lsm = torch.log_softmax(logits[0], 0)
    assert toks == [2] and set(lps[0]) == {2, 1}
    assert lps[0][2] == pytest.approx(lsm[2].item()) and math.isclose(lps[0][1], lsm[1].item(), rel_tol=1e-6)


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_k", -2), ("min_p", 1.5), ("n", 0),
                                           ("presence_penalty", 3.0), ("logprobs", -1), ("stop", [""])])
def test_validation_names_the_field(field, value):
    from kiln.errors import InputError

    with pytest.raises(InputError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_batched_penalties_equal_the_per_row_rule():
    """Rows with different penalties at once (one scatter for all): each row as the rule says, token ids outside
    the vocabulary ignored, rows without penalties untouched."""
    from kiln.llm import sampling

    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(5, vocab)
    specs = [{"repetition_penalty": 1.7}, {"frequency_penalty": 0.8, "presence_penalty": 0.3}, {},
             {"repetition_penalty": 0.6, "frequency_penalty": -0.5}, {"presence_penalty": 1.2}]
    seqs = []
    for i, kw in enumerate(specs):
        s = seq([1, 2, 3, 2, 50], temperature=0, **kw)
        s.token_ids += [3, 3, 7, i]
        seqs.append(s)
    want = logits.clone()
    for r, s in enumerate(seqs):
        p = s.params
        seen = torch.tensor(sorted({t for t in s.token_ids if t < vocab}))
        v = want[r, seen]
        want[r, seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        counts = torch.bincount(torch.tensor(s.output_token_ids), minlength=vocab).float()
        want[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    got = logits.clone()
    sampling._penalize(got, [0, 1, 3, 4], seqs, [s.params for s in seqs])
    assert torch.allclose(got, want) and torch.equal(got[2], logits[2])
