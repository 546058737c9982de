"""Sampler behaviour: greedy is argmax, seeds are batch- and position-determined, truncation and
penalties."""

from __future__ import annotations

import math

import pytest
import torch

from sluice.protocol import SamplingParams
from sluice.workers.sampler import Continued, SampleRow, apply_penalties, sample, uniform

pytestmark = pytest.mark.unit

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _row(params: SamplingParams, seed: int | None = None, prompt=(1, 2), output=()) -> SampleRow:
    return SampleRow(params, list(prompt), list(output), seed)


def test_greedy_is_argmax_of_raw_logits() -> None:
    logits = _logits(4)
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(4)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()
    # top_k=1 is greedy too, whatever the temperature
    rows = [_row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(4)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def _draw(logits_row: torch.Tensor, params: SamplingParams, seed: int, n: int, batch_noise: int) -> list[int]:
    """n tokens for one seeded request placed among `batch_noise` other random rows."""
    out: list[int] = []
    for step in range(n):
        others = _logits(batch_noise, seed=100 + step) if batch_noise else torch.empty(0, VOCAB)
        logits = torch.cat([others, logits_row[None]])
        rows = [_row(SamplingParams(temperature=1.0), seed=step) for _ in range(batch_noise)]
        rows.append(SampleRow(params, [1], out.copy(), seed))
        out.append(sample(logits, rows).token_ids[-1])
    return out


def test_seed_gives_same_tokens_regardless_of_batch() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    row = _logits(1, seed=3)[0] / 3  # flat-ish: many tokens are plausible
    alone = _draw(row, params, seed=7, n=20, batch_noise=0)
    crowded = _draw(row, params, seed=7, n=20, batch_noise=5)
    assert alone == crowded
    assert len(set(alone)) > 1  # it really samples
    assert _draw(row, params, seed=8, n=20, batch_noise=0) != alone


def test_a_draw_depends_on_seed_and_position_only() -> None:
    """Worker failover: a seeded request resumed at position k samples what the undisturbed run did."""
    params = SamplingParams(temperature=1.0, seed=7)
    row = _logits(1, seed=3)[0] / 3
    undisturbed = _draw(row, params, seed=7, n=20, batch_noise=0)
    k = 9
    resumed = list(undisturbed[:k])
    for _ in range(k, 20):  # the first k tokens came from "another worker": no state is carried over
        resumed.append(sample(row[None], [SampleRow(params, [1], resumed.copy(), 7)]).token_ids[0])
    assert resumed == undisturbed
    assert uniform(7, 3) == uniform(7, 3) != uniform(7, 4)
    assert uniform(7, 3) != uniform(8, 3) and uniform(-1, 0) == uniform(2**64 - 1, 0)
    draws = [uniform(11, p) for p in range(4000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.02  # roughly uniform
    assert sum(u < 0.25 for u in draws) / len(draws) == pytest.approx(0.25, abs=0.03)


def test_top_k_and_top_p_and_min_p_restrict_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0] + [-10.0] * (VOCAB - 4)])

    def support(params: SamplingParams) -> set[int]:
        return {sample(logits, [SampleRow(params, [1], [], seed)]).token_ids[0] for seed in range(300)}

    assert support(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    # probabilities ~ .64 .24 .09 .03: top_p .8 keeps tokens until their mass before reaches .8
    assert support(SamplingParams(temperature=1.0, top_p=0.8)) == {0, 1}
    # min_p 0.3: keep p >= 0.3 * 0.64
    assert support(SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1}
    assert support(SamplingParams(temperature=1.0, top_p=0.95)) == {0, 1, 2}


def test_low_temperature_concentrates_on_argmax() -> None:
    logits = _logits(1, seed=5) / 3
    params = SamplingParams(temperature=0.05)
    picks = {sample(logits, [SampleRow(params, [1], [], seed)]).token_ids[0] for seed in range(50)}
    assert picks == {int(logits.argmax())}


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4], logits[0, 5] = 2.0, -2.0, 1.0
    row = _row(SamplingParams(repetition_penalty=2.0), prompt=[3], output=[4])
    out = apply_penalties(logits, [row])
    assert out[0, 3] == 1.0  # positive seen logit divided
    assert out[0, 4] == -4.0  # negative seen logit multiplied
    assert out[0, 5] == 1.0  # unseen untouched


def test_presence_and_frequency_penalties_openai_semantics() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = _row(params, prompt=[9, 9], output=[3, 3, 3, 4])
    out = apply_penalties(logits, [row])
    assert out[0, 3].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert out[0, 4].item() == pytest.approx(-(0.5 + 0.25))
    assert out[0, 9].item() == 0.0  # prompt tokens are not counted


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 1.0, 0.9
    plain = sample(logits, [_row(SamplingParams(temperature=0.0), output=[7])]).token_ids
    penalised = sample(logits, [_row(SamplingParams(temperature=0.0, presence_penalty=0.5), output=[7])])
    assert plain == [7] and penalised.token_ids == [8]


def test_logprobs_are_log_softmax_of_penalised_tempered_logits() -> None:
    logits = _logits(2, seed=9)
    params = SamplingParams(temperature=0.5, logprobs=True, top_logprobs=3, seed=1)
    rows = [_row(params, seed=1), _row(SamplingParams(temperature=0.0))]
    out = sample(logits, rows)
    lp = (logits[0] / 0.5).log_softmax(-1)
    first = out.logprobs[0]
    assert first is not None and out.logprobs[1] is None
    assert first.chosen.token_id == out.token_ids[0]
    assert first.chosen.logprob == pytest.approx(lp[out.token_ids[0]].item(), abs=1e-5)
    assert [t.token_id for t in first.top] == lp.topk(3).indices.tolist()
    assert math.fsum(math.exp(t.logprob) for t in first.top) < 1.0


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=2.5), dict(top_p=0.0), dict(top_k=-1), dict(min_p=1.5),
    dict(presence_penalty=3.0), dict(repetition_penalty=0.0), dict(max_tokens=0),
    dict(top_logprobs=3), dict(stop=("",)), dict(temperature=float("nan")),
])
def test_invalid_params_raise_value_error(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()


def test_mismatched_rows_raise() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        sample(_logits(2), [_row(SamplingParams(temperature=0.0))])


def test_continued_reads_like_the_list_it_stands_for() -> None:
    """A draft row's output so far: the request's output then the drafts before the row, read
    without copying the output (indexing, negative indices, slices, iteration, length)."""
    base, extra = [5, 6, 7], (8, 9)
    joined = Continued(base, extra)
    whole = [*base, *extra]
    assert len(joined) == 5 and list(joined) == whole
    assert [joined[i] for i in range(-5, 5)] == [whole[i] for i in range(-5, 5)]
    assert joined[1:4] == whole[1:4] and joined[::-2] == whole[::-2]
    for bad in (5, -6):
        with pytest.raises(IndexError):
            joined[bad]
    assert list(Continued([], ())) == [] and Continued([], (3,))[0] == 3
