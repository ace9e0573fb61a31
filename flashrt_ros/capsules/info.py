"""CapsuleInfo: the public description of a capsule (the fields of msg/CapsuleInfo.msg)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CapsuleInfo:
    id: str
    name: str
    session: str
    parent_id: str
    step: int
    nbytes: int
    tier: str  # "gpu" | "host" | "disk" | "cpu"
    checksum: str
    pinned: bool
    stamp: float  # seconds since the epoch

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        """How logs and replies name it: the id, and the name a planner knows it by."""
        return f"{self.id} ({self.name!r})" if self.name else self.id
