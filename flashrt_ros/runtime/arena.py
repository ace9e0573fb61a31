"""The state arena: every byte a session needs to continue, in ONE contiguous device allocation.

One allocation is what makes a capsule a single copy: checkpoint, restore and branch move the
whole arena with one device-to-device memcpy instead of one launch per tensor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from flashrt_ros.policies import rng
from flashrt_ros.policies.base import ROLES, StateEntry

ALIGN = 256  # bytes; matches the CUDA allocator's alignment so every view is vector-aligned


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class LayoutRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str
    offset: int
    nbytes: int


def plan_layout(spec: list[StateEntry]) -> tuple[list[LayoutRow], int]:
    """Assign aligned offsets in declaration order; returns the rows and the padded total size."""
    names = [e.name for e in spec]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate state names in spec: {names}")
    rows, off = [], 0
    for e in spec:
        if e.role not in ROLES:
            raise ValueError(f"state {e.name!r}: unknown role {e.role!r} (one of {ROLES})")
        rows.append(
            LayoutRow(
                e.name, str(e.dtype).replace("torch.", ""), tuple(e.shape), e.role, off, e.nbytes
            )
        )
        off = _round_up(off + e.nbytes)
    return rows, max(off, ALIGN)


def layout_table(rows: list[LayoutRow]) -> list[dict]:
    """The layout as plain data (fingerprints and capsule files): name, dtype, shape, role,
    offset, bytes."""
    return [
        {
            "name": r.name,
            "dtype": r.dtype,
            "shape": list(r.shape),
            "role": r.role,
            "offset": r.offset,
            "nbytes": r.nbytes,
        }
        for r in rows
    ]


class Arena:
    """A session's state: `buf` is the one allocation, `views` are named tensors aliasing it."""

    def __init__(self, spec: list[StateEntry], device: torch.device):
        self.spec = list(spec)
        self.rows, self.nbytes = plan_layout(self.spec)
        self.device = torch.device(device)
        # over-allocate by ALIGN so the base is aligned on any allocator (the CPU's gives 64)
        self._raw = torch.zeros(self.nbytes + ALIGN, dtype=torch.uint8, device=self.device)
        skew = (-self._raw.data_ptr()) % ALIGN
        self.buf = self._raw[skew : skew + self.nbytes]
        self.views: dict[str, torch.Tensor] = {}
        for e, r in zip(self.spec, self.rows, strict=True):
            raw = self.buf[r.offset : r.offset + r.nbytes]
            self.views[e.name] = raw.view(e.dtype).view(e.shape)

    def float_spans(self, names: list[str]) -> list[torch.Tensor]:
        """The floating-point regions `names` as few views as cover them: neighbours in the
        layout (no other region between them) of one dtype become one view over both and the
        alignment padding between them. A finite check then costs two kernels per span, not
        per region (builtin:hybrid: 2 spans for 8 regions). Padding is zero unless the bytes
        came from elsewhere (a capsule file), so a non-finite span is checked again region by
        region before anything is refused."""
        wanted, spans, cur = set(names), [], None  # cur: [dtype, start, end]
        for r in self.rows:
            if r.nbytes == 0:  # no bytes: it separates nothing and needs no check
                continue
            dt = self.views[r.name].dtype if r.name in wanted else None
            if dt is not None and cur is not None and cur[0] == dt:
                cur[2] = r.offset + r.nbytes
                continue
            if cur is not None:
                spans.append(cur)
            cur = [dt, r.offset, r.offset + r.nbytes] if dt is not None else None
        if cur is not None:
            spans.append(cur)
        return [self.buf[a:b].view(dt) for dt, a, b in spans]

    def snapshot_bytes(self) -> bytes:
        """Host copy of the whole arena (tests and the disk tier; syncs)."""
        return self.buf.cpu().numpy().tobytes()


def fingerprint(policy_id: str, weights_digest: str, layout: list[dict], device_type: str) -> str:
    """Digest of what gives a capsule meaning: which policy, weights, layout and device, and
    the version of the counter-based noise (the same state draws other noise under another)."""
    blob = json.dumps(
        {
            "policy": policy_id,
            "weights": weights_digest,
            "layout": layout,
            "device": device_type,
            "noise": rng.VERSION,
        },
        sort_keys=True,
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
