"""Counter-based noise: randomness that lives in the state, so a restore replays it exactly.

A stateful torch.Generator is outside the arena (a capsule would not capture it) and is awkward
inside a CUDA graph. Instead the noise is a pure integer hash of (key, counter, lane), computed with
int64 tensor ops that run identically on the CPU and the GPU and inside a captured graph.
"""

from __future__ import annotations

import torch

# What the noise of a (key, counter, lane) is: part of every engine fingerprint, so a capsule
# taken under one version is never continued under another's noise. 2: the stream id kept all
# 32 bits (version 1 kept 16: its noise repeated within seconds of ticks, and across seeds).
# 3: key and counter are hashed apart before they meet (in 2 the id was linear in them, so a
# seed's noise was another seed's shifted in time: seed 106903's at tick t was seed 0's at t + 733).
VERSION = 3

_M1 = 0x9E3779B1
_M2 = 0x85EBCA77
_MASK32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values (their low 32 bits). The products can pass 2**63
    and wrap negative; the low 32 bits of each step are the unsigned computation's all the same
    (a right shift by 29 or 31 only brings bits below 63 into them), and those are kept."""
    x = (x & _MASK32) * _M2
    x = x ^ (x >> 29)
    x = (x & _MASK32) * _M1
    x = x ^ (x >> 31)
    return x & _MASK32


def hashed_normal(key: torch.Tensor, counter: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """Standard normal samples, one per lane, from int64 (…,1) key/counter and an int64 lane index.

    Box-Muller over two 32-bit uniforms per lane. Key and counter are hashed apart and then
    together into a 32-bit stream id (no linear relation between seeds: no seed's noise is
    another's shifted in time), and each lane's words mix their own hash with it: two (seed,
    tick) pairs share noise only when their ids collide, one chance in 2**32 per pair.
    """
    stream = _mix(_mix(key) ^ _mix(counter + 0x6A09E667))
    u1 = (_mix(_mix(lanes * 2) ^ stream).to(torch.float32) + 1.0) / 4294967297.0
    u2 = _mix(_mix(lanes * 2 + 1) ^ stream).to(torch.float32) / 4294967296.0
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(6.283185307179586 * u2)
