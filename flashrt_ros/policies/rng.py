"""Counter-based noise: randomness that lives in the state, so a restore replays it exactly.

A stateful torch.Generator is outside the arena (a capsule would not capture it) and is awkward
inside a CUDA graph. Instead the noise is a pure integer hash of (key, counter, lane), computed with
int64 tensor ops that run identically on the CPU and the GPU and inside a captured graph.
"""

from __future__ import annotations

import torch

_M1 = 0x9E3779B1
_M2 = 0x85EBCA77
_MASK32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    # values stay below 2**62, so int64 never overflows and right shifts are logical
    x = (x & _MASK32) * _M2
    x = x ^ (x >> 29)
    x = (x & _MASK32) * _M1
    x = x ^ (x >> 31)
    return x & _MASK32


def hashed_normal(key: torch.Tensor, counter: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """Standard normal samples, one per lane, from int64 (…,1) key/counter and an int64 lane index.

    Box-Muller over two independent 32-bit uniforms; deterministic and device independent.
    """
    base = _mix(key * 0x632BE5AB + counter) * 0x10000 + lanes * 2
    u1 = (_mix(base).to(torch.float32) + 1.0) / 4294967297.0
    u2 = _mix(base + 1).to(torch.float32) / 4294967296.0
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(6.283185307179586 * u2)
