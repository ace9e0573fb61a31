"""The counter-based noise (policies/rng.py): every tick and every seed draws its own."""

from __future__ import annotations

import torch

from flashrt_ros.policies.rng import hashed_normal


def _draws(keys, counters, lanes: int = 48) -> torch.Tensor:
    k = torch.tensor(keys, dtype=torch.int64)[:, None]
    c = torch.tensor(counters, dtype=torch.int64)[:, None]
    return hashed_normal(k, c, torch.arange(lanes, dtype=torch.int64)[None])


def test_no_two_ticks_or_seeds_share_their_noise():
    """Version 1 kept 16 bits of the stream id: seed 0 drew the same 48 values at ticks 1 and
    13, and 48 of seeds 0..2999 shared their first tick's noise with another seed."""
    ticks = _draws([0] * 5000, list(range(5000)))
    assert len({tuple(row.tolist()) for row in ticks}) == 5000
    seeds = _draws(list(range(3000)), [0] * 3000)
    assert len({tuple(row.tolist()) for row in seeds}) == 3000


def test_the_noise_is_standard_normal_and_its_lanes_independent():
    x = _draws([7] * 2000, list(range(2000)), lanes=64)
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1.0) < 0.01
    lag = torch.corrcoef(torch.stack([x[:, :-1].reshape(-1), x[:, 1:].reshape(-1)]))[0, 1]
    assert abs(float(lag)) < 0.01  # neighbouring lanes
    again = _draws([7] * 2000, list(range(2000)), lanes=64)
    assert torch.equal(x, again)  # a pure function: a restore replays it


def test_no_seed_draws_another_seeds_noise_shifted_in_time():
    """Version 2's stream id was linear in (seed, tick): seed 106903 at tick t drew seed 0's
    noise of tick t + 733. Key and counter are hashed apart now."""
    t = list(range(1000))
    other = _draws([106903] * 1000, t, lanes=8)
    zero_later = _draws([0] * 1000, [c + 733 for c in t], lanes=8)
    assert not any(torch.equal(a, b) for a, b in zip(other, zero_later, strict=True))
