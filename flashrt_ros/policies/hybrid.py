"""builtin:hybrid — a small stateful policy for a 6-joint arm that exercises every kind of state.

Per step (one observation token): a causal depthwise temporal convolution over the last inputs,
a GRU cell, attention layers over a KV ring holding the observation history (ALiBi-style age
bias, so the ring can be made longer without new weights), a head that predicts a chunk of
absolute joint targets plus counter-based noise, and an action-chunk queue whose overlapping
predictions are blended by temporal ensembling. Every piece of that state lives in the arena.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from flashrt_ros.policies.base import Policy, StateEntry
from flashrt_ros.policies.rng import hashed_normal


@dataclass(frozen=True)
class HybridConfig:
    obs_dim: int = 12
    action_dim: int = 6
    goal_dim: int = 6
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    kv_len: int = 64
    conv_k: int = 4
    chunk_len: int = 8
    ensemble_decay: float = 0.3
    noise_std: float = 0.002

    def tag(self) -> str:
        """The policy id's configuration part, which the engine fingerprint reads: every field
        that changes what a step computes. The two floats are named only when they differ from
        their defaults, so the default configuration keeps the id (and capsule files) it had."""
        tag = (
            f"d{self.d_model}-l{self.n_layers}-h{self.n_heads}-kv{self.kv_len}"
            f"-k{self.conv_k}-c{self.chunk_len}"
        )
        if self.ensemble_decay != HybridConfig.ensemble_decay:
            tag += f"-e{float(self.ensemble_decay)!r}"  # 0 and 0.0: one id
        if self.noise_std != HybridConfig.noise_std:
            tag += f"-n{float(self.noise_std)!r}"
        return tag


class _Block(nn.Module):
    # outside the state dict, computed from the config (policy_checks.py)
    derived_buffers = ("slopes",)

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(n_heads)])
        self.register_buffer("slopes", slopes, persistent=False)


class HybridPolicy(Policy):
    """See the module docstring. `step` works on any leading batch size sharing one step counter."""

    # outside the state dict, computed from the config (policy_checks.py)
    derived_buffers = ("ring_idx", "chunk_idx", "noise_lanes")

    def __init__(self, config: HybridConfig | None = None):
        super().__init__()
        c = config or HybridConfig()
        self.config = c
        self.policy_id = f"builtin:hybrid/{c.tag()}"
        self.obs_dim, self.action_dim, self.goal_dim = c.obs_dim, c.action_dim, c.goal_dim
        self.chunk_len = c.chunk_len
        d = c.d_model
        self.inp = nn.Linear(c.obs_dim + c.goal_dim, d)
        self.conv_w = nn.Parameter(torch.randn(c.conv_k, d) / math.sqrt(c.conv_k))
        self.conv_b = nn.Parameter(torch.zeros(d))
        self.gru = nn.GRUCell(d, d)
        self.blocks = nn.ModuleList(_Block(d, c.n_heads) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, c.chunk_len * c.action_dim)
        self.register_buffer("obs_mean", torch.zeros(c.obs_dim))
        self.register_buffer("obs_std", torch.ones(c.obs_dim))
        self.register_buffer("delta_scale", torch.tensor(0.05))
        self.register_buffer("ring_idx", torch.arange(c.kv_len), persistent=False)
        self.register_buffer("chunk_idx", torch.arange(c.chunk_len), persistent=False)
        lanes = torch.arange(c.chunk_len * c.action_dim, dtype=torch.int64)
        self.register_buffer("noise_lanes", lanes, persistent=False)

    # -- protocol -----------------------------------------------------------------------------
    def state_spec(self) -> list[StateEntry]:
        c = self.config
        dh = c.d_model // c.n_heads
        f32 = torch.float32
        spec = []
        for i in range(c.n_layers):
            spec.append(StateEntry(f"k{i}", f32, (1, c.kv_len, c.n_heads, dh), "kv"))
            spec.append(StateEntry(f"v{i}", f32, (1, c.kv_len, c.n_heads, dh), "kv"))
        spec += [
            StateEntry("h", f32, (1, c.d_model), "recurrent"),
            StateEntry("conv", f32, (1, c.conv_k - 1, c.d_model), "conv"),
            StateEntry("queue", f32, (1, c.chunk_len, c.chunk_len, c.action_dim), "queue"),
            StateEntry("rng", torch.int64, (1, 2), "noise"),
        ]
        return spec

    def init_state(self, state: dict[str, torch.Tensor], seed: int) -> None:
        state["rng"][:, 0] = int(seed) & 0x7FFFFFFF
        state["rng"][:, 1] = 0

    def step(self, obs, state, action, chunk) -> None:
        act, new_chunk = self.forward_state(obs, state, inplace=True)
        action.copy_(act)
        chunk.copy_(new_chunk)

    # -- the computation ----------------------------------------------------------------------
    def forward_state(self, obs: torch.Tensor, state: dict, inplace: bool):
        """One step. inplace=True updates `state` tensors in place (serving); False rebinds the
        dict entries to new tensors so autograd can train through a rollout."""
        c = self.config

        def put(name: str, new: torch.Tensor) -> None:
            if inplace:
                state[name].copy_(new)
            else:
                state[name] = new

        cnt = state["step"]  # (B,) int64, same for every batch row
        q_pos = obs[:, : c.action_dim]
        x_in = torch.cat([(obs - self.obs_mean) / self.obs_std, state["goal"] - q_pos], -1)
        x = self.inp(x_in)

        win = torch.cat([state["conv"], x[:, None]], 1)
        y = F.silu((win * self.conv_w).sum(1) + self.conv_b)
        put("conv", win[:, 1:])

        h = self.gru(y, state["h"])
        put("h", h)
        z = h + y

        pos = (cnt % c.kv_len)[:1]
        n_valid = torch.clamp(cnt + 1, max=c.kv_len)
        age = (pos[:, None] - self.ring_idx[None]) % c.kv_len  # (1, L)
        mask = age < n_valid[:, None]  # (B, L)
        B = obs.shape[0]
        dh = c.d_model // c.n_heads
        for i, blk in enumerate(self.blocks):
            qkv = blk.qkv(blk.ln1(z)).view(B, 3, c.n_heads, dh)
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
            K, V = state[f"k{i}"], state[f"v{i}"]
            if inplace:
                K.index_copy_(1, pos, k[:, None])
                V.index_copy_(1, pos, v[:, None])
            else:
                K = K.index_copy(1, pos, k[:, None])
                V = V.index_copy(1, pos, v[:, None])
                state[f"k{i}"], state[f"v{i}"] = K, V
            s = torch.einsum("bhd,blhd->bhl", q, K) / math.sqrt(dh)
            s = s - blk.slopes[None, :, None] * age[:, None, :].to(s.dtype)
            s = s.masked_fill(~mask[:, None, :], float("-inf"))
            att = torch.einsum("bhl,blhd->bhd", torch.softmax(s, -1), V).reshape(B, c.d_model)
            z = z + blk.proj(att)
            z = z + blk.mlp(blk.ln2(z))

        delta = self.head(self.ln_f(z)).view(B, c.chunk_len, c.action_dim) * self.delta_scale
        rng = state["rng"]
        noise = hashed_normal(rng[:, :1], rng[:, 1:2], self.noise_lanes[None])
        new_chunk = q_pos[:, None] + delta + c.noise_std * noise.view_as(delta)
        put("rng", torch.stack([rng[:, 0], rng[:, 1] + 1], 1))

        queue = torch.cat([new_chunk[:, None], state["queue"][:, :-1]], 1)
        put("queue", queue)
        diag = queue.diagonal(dim1=1, dim2=2)  # (B, A, C): prediction made i steps ago for now
        valid = self.chunk_idx[None] <= cnt[:, None]
        w = torch.exp(-c.ensemble_decay * self.chunk_idx.to(diag.dtype))[None] * valid
        act = (diag * w[:, None]).sum(-1) / w.sum(-1, keepdim=True)
        return act, new_chunk
