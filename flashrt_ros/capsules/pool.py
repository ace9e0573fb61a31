"""The capsule pool: a pre-allocated device slab of arena-sized slots, LRU, pinning, host spill.

Nothing is allocated per checkpoint: a checkpoint is one device copy into a free slot (evicting
the least recently used unpinned capsule when none is free), plus a checksum computed by the
device on the copy, or, when the caller already has the source's digest (the Engine's checkpoint
probe), a 16-byte device copy of it. The pool knows bytes and bookkeeping only; the Engine
decides what to copy.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from flashrt_ros.capsules.checksum import device_checksum, to_hex
from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.capsules.names import check_capsule_name
from flashrt_ros.cuda.copy import copy_bytes
from flashrt_ros.errors import BadName, BadRequest, CapacityError, UnknownReference, shown


@dataclass
class Capsule:
    """Bookkeeping of one live capsule; `slot`/`host_slot` say where its bytes are."""

    info: CapsuleInfo
    slot: int | None
    host_slot: int | None
    digest: torch.Tensor  # device checksum lanes; hex is materialized lazily
    last_used: int


class CapsulePool:
    def __init__(self, nbytes: int, device: torch.device, slots: int, host_slots: int = 0):
        for what, v, lo in (("capsule_slots", slots, 1), ("host_capsule_slots", host_slots, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise BadRequest(f"{what} must be an integer >= {lo}, got {v!r}")
        self.nbytes = int(nbytes)
        self.device = torch.device(device)
        self.slab = torch.empty((slots, self.nbytes), dtype=torch.uint8, device=self.device)
        pin = self.device.type == "cuda"
        self.host = torch.empty((host_slots, self.nbytes), dtype=torch.uint8, pin_memory=pin)
        # one digest row per slot, written by the checksum kernel (or copied from the caller's
        # digest, see put): no allocation per checkpoint
        self.digests = torch.zeros((slots, 2), dtype=torch.int64, device=self.device)
        self._digest_bytes = self.digests.view(torch.uint8)  # (slots, 16): rows for copy_bytes
        # each slot's rows as views made once: indexing a tensor costs ~1-3 us a time, and a
        # checkpoint took three (its slot, its digest row twice)
        self._slot_rows = list(self.slab.unbind(0))
        self._digest_rows = list(self._digest_bytes.unbind(0))
        self._digest_lanes = list(self.digests.unbind(0))
        self._probe = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.free = list(range(slots))[::-1]
        self.free_host = list(range(host_slots))[::-1]
        self.caps: dict[str, Capsule] = {}
        self._clock = itertools.count(1)
        self._next_id = 1  # the number the next fresh id starts from (c0007: 7)
        # ids below reserved_to are reserved on disk (the Engine's IdReserve, with capsule_dir);
        # reserve(n) is called when the counter reaches it and returns the new limit
        self.reserve: Callable[[int], int] | None = None
        self.reserved_to = 0
        self.gpu_tier = "gpu" if self.device.type == "cuda" else "cpu"
        # capsules dropped by eviction, newest last, as `id ('name')` (for logs and replies)
        self.evicted: list[str] = []
        # ids a new capsule must not take though none is live (the Engine: ids whose file is in
        # capsule_dir, so drop never removes another capsule's file)
        self.id_taken: Callable[[str], bool] = lambda cid: False
        # what an unknown reference may still name (the Engine: a file of capsule_dir)
        self.missing_hint: Callable[[str], str] = lambda ref: ""

    # -- lookups -----------------------------------------------------------------------------------
    def get(self, ref: str) -> Capsule:
        """A capsule by id or by name; UnknownReference when neither is live."""
        if not isinstance(ref, str) or not ref:
            raise BadRequest(f"capsule reference must be a non-empty id or name, got {ref!r}")
        cap = self.caps.get(ref)
        if cap is None:
            cap = next((c for c in self.caps.values() if c.info.name == ref), None)
        if cap is None:
            raise UnknownReference(
                f"unknown capsule {shown(ref)} (list_capsules shows the live ones)"
                + self.missing_hint(ref)
            )
        return cap

    def infos(self) -> list[CapsuleInfo]:
        return [self.info(c) for c in sorted(self.caps.values(), key=lambda c: c.info.stamp)]

    def info(self, cap: Capsule) -> CapsuleInfo:
        if not cap.info.checksum:
            cap.info = replace(cap.info, checksum=to_hex(cap.digest))
        return cap.info

    def bytes_used(self) -> int:
        return sum(1 for c in self.caps.values() if c.slot is not None) * self.nbytes

    def bytes_total(self) -> int:
        return self.slab.shape[0] * self.nbytes

    def check_name_free(self, name: str) -> None:
        if any(c.info.name == name for c in self.caps.values()):
            raise BadName(f"capsule name {name!r} is taken; drop that capsule first")

    def new_id(self) -> str:
        """A fresh id, used up: never live, never one whose file exists (id_taken)."""
        cid = self.peek_id(self.id_taken)
        self.claim_id(cid)
        return cid

    # -- taking a capsule --------------------------------------------------------------------------
    def _take_slot(self) -> int:
        """A device slot, freed by evicting the least recently used unpinned capsule when none
        is free."""
        if self.free:
            return self.free.pop()
        victims = [c for c in self.caps.values() if c.slot is not None and not c.info.pinned]
        if not victims:
            self.require_room()
        victim = min(victims, key=lambda c: c.last_used)
        self._spill_or_drop(victim)
        return self.free.pop()

    def _spill_or_drop(self, cap: Capsule) -> None:
        """Move an evicted capsule to the host tier; with that tier full, the least recently
        used of it and the host tier's capsules is dropped (the LRU order holds across tiers:
        a capsule just restored from the host tier is not the first to go)."""
        if self.host.shape[0] == 0:
            self.evicted.append(cap.info.label())
            self._release(cap)
            return
        if not self.free_host:
            oldest = min(
                (c for c in self.caps.values() if c.host_slot is not None),
                key=lambda c: c.last_used,
                default=None,
            )
            if oldest is None or cap.last_used < oldest.last_used:
                self.evicted.append(cap.info.label())
                self._release(cap)
                return
            self.evicted.append(oldest.info.label())
            self._release(oldest)
        hs = self.free_host.pop()
        self.host[hs].copy_(self._slot_rows[cap.slot], non_blocking=True)
        cap.digest = cap.digest.clone()  # the slot's digest row goes to the next capsule
        self.free.append(cap.slot)
        cap.slot, cap.host_slot = None, hs
        cap.info = replace(cap.info, tier="host")

    def _release(self, cap: Capsule) -> None:
        if cap.slot is not None:
            self.free.append(cap.slot)
        if cap.host_slot is not None:
            self.free_host.append(cap.host_slot)
        del self.caps[cap.info.id]

    def put(
        self,
        src: torch.Tensor,
        *,
        name: str = "",
        session: str,
        parent_id: str,
        step: int,
        pinned: bool = False,
        cid: str | None = None,
        stamp: float | None = None,
        digest: torch.Tensor | None = None,
        checksum: str = "",
    ) -> Capsule:
        """Copy `src` (the arena bytes, device or host) into a slot. One copy, one checksum.

        `digest` (int64[2] on the pool's device) is src's checksum already computed, and
        `checksum` its hex, both read from the same bytes (Engine.checkpoint's probe): the slot's
        digest row then gets a copy of `digest` instead of a second pass over the bytes (the copy
        is exact, so it is the slot's digest too), and the hex needs no readback later."""
        self.check_new(name)
        if cid is not None and cid in self.caps:
            cid = None
        if src.numel() != self.nbytes:  # before a slot is taken (and somebody maybe evicted)
            raise ValueError(f"a capsule holds {self.nbytes} bytes, got {src.numel()}")
        lanes = None if digest is None else digest.view(torch.uint8)
        if lanes is not None and lanes.numel() != 16:
            raise ValueError(f"a digest is 2 int64 lanes, got {tuple(digest.shape)}")
        slot = self._take_slot()
        dst = self._slot_rows[slot]
        copy_bytes(dst, src)  # device to device, or torch's copy for a host source
        if lanes is None:
            device_checksum(dst, out=self._digest_lanes[slot])
        else:  # 16 bytes device to device, queued like the copy: no sync
            copy_bytes(self._digest_rows[slot], lanes)
        return self._record(slot, name, session, parent_id, step, pinned, cid, stamp, checksum)

    def check_new(self, name: str) -> None:
        """BadName unless `name` ("" = none) may name a new capsule."""
        if name:
            check_capsule_name(name)
            self.check_name_free(name)

    def free_slot(self) -> int | None:
        """The slot the next put takes when one is free (None: it would evict); for a caller
        that fills it itself before adopt()."""
        return self.free[-1] if self.free else None

    def slot_row(self, slot: int) -> torch.Tensor:
        """`slot`'s bytes (uint8, the arena's size), for a caller that fills the slot itself."""
        return self._slot_rows[slot]

    def digest_row(self, slot: int) -> torch.Tensor:
        """The 16 bytes of `slot`'s digest, for a caller that fills the slot itself."""
        return self._digest_rows[slot]

    def adopt(
        self,
        slot: int,
        *,
        name: str = "",
        session: str,
        parent_id: str,
        step: int,
        pinned: bool = False,
        checksum: str = "",
        cid: str | None = None,
        stamp: float | None = None,
    ) -> Capsule:
        """A capsule for free `slot`, whose bytes and digest row the caller filled (the Engine's
        checkpoint probe, in the pass that checked them): bookkeeping only. `cid` (a fresh id
        from peek_id, made while the pass ran) is used up here, as new_id's would be."""
        self.check_new(name)
        if cid is not None and cid in self.caps:
            raise BadRequest(f"capsule id {cid} is taken")
        self.free.remove(slot)  # ValueError when it is not free: nothing changed
        cap = self._record(slot, name, session, parent_id, step, pinned, cid, stamp, checksum)
        if cid is not None:
            self.claim_id(cid)
        return cap

    def _record(self, slot, name, session, parent_id, step, pinned, cid, stamp, checksum):
        info = CapsuleInfo(
            id=cid or self.new_id(),
            name=name,
            session=session,
            parent_id=parent_id,
            step=int(step),
            nbytes=self.nbytes,
            tier=self.gpu_tier,
            checksum=checksum,
            pinned=bool(pinned),
            stamp=time.time() if stamp is None else float(stamp),
        )
        cap = Capsule(info, slot, None, self._digest_lanes[slot], next(self._clock))
        self.caps[info.id] = cap
        return cap

    # -- using a capsule ---------------------------------------------------------------------------
    def source(self, cap: Capsule) -> torch.Tensor:
        """The capsule's bytes where they are (a slab row or a pinned host row), for copies
        queued on the device (a spill into a host row is queued too: no wait needed)."""
        return self._slot_rows[cap.slot] if cap.slot is not None else self.host[cap.host_slot]

    def readable(self, cap: Capsule) -> torch.Tensor:
        """source() for the host to read (a file write): a host row a spill has just been
        queued into is waited for first."""
        if cap.host_slot is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.source(cap)

    def copy_out(self, cap: Capsule, dst: torch.Tensor) -> None:
        """dst <- capsule bytes with one copy; marks the capsule recently used."""
        copy_bytes(dst, self.source(cap))  # a host-tier source: a plain async copy
        cap.last_used = next(self._clock)

    def matches(self, cap: Capsule, buf: torch.Tensor) -> bool:
        """Whether `buf` (device bytes) has the capsule's checksum (one sync)."""
        return torch.equal(device_checksum(buf, out=self._probe), cap.digest)

    def drop(self, ref: str) -> CapsuleInfo:
        cap = self.get(ref)
        info = self.info(cap)
        self._release(cap)
        return info

    def set_pinned(self, ref: str, pinned: bool) -> CapsuleInfo:
        """Pin or unpin. A pinned capsule lives in a device slot: one in the host tier comes
        back into one first (evicting the least recently used unpinned capsule when none is
        free; CapacityError, changing nothing, when every slot is pinned)."""
        cap = self.get(ref)
        if pinned and cap.slot is None:
            self.require_room(f" to pin {cap.info.id} (it is in the host tier)")
            self._promote(cap)
        cap.info = replace(cap.info, pinned=bool(pinned))
        return self.info(cap)

    def _promote(self, cap: Capsule) -> None:
        """A host-tier capsule back into a device slot. Its bytes go through a device buffer
        of their own (a rare call: allocated here), queued before its host row is given up, so
        the capsule evicted for the slot can spill into that very row."""
        staged = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        copy_bytes(staged, self.host[cap.host_slot])
        self.free_host.append(cap.host_slot)
        cap.host_slot = None  # in no tier for a moment: neither a victim nor dropped for one
        slot = self._take_slot()  # the caller checked there is room: nothing raises here
        copy_bytes(self._slot_rows[slot], staged)
        copy_bytes(self._digest_rows[slot], cap.digest.view(torch.uint8))
        cap.slot, cap.digest = slot, self._digest_lanes[slot]
        cap.info = replace(cap.info, tier=self.gpu_tier)

    # -- for the disk tier (a persist checks everything before it writes a file) ----------------
    def free_slots(self) -> int:
        """Device slots a put takes without evicting anybody (a reload fills only these)."""
        return len(self.free)

    def has_room(self) -> bool:
        """Whether a put finds a slot: a free one, or one an unpinned capsule can give up."""
        return bool(self.free) or any(
            c.slot is not None and not c.info.pinned for c in self.caps.values()
        )

    def require_room(self, note: str = "") -> None:
        """CapacityError (ending with `note`) unless a put finds a slot."""
        if not self.has_room():
            raise CapacityError(
                f"capsule pool full: all {self.slab.shape[0]} slots hold pinned capsules; "
                f"unpin or drop one, or raise capsule_slots{note}"
            )

    def peek_id(self, skip: Callable[[str], bool] = lambda cid: False) -> str:
        """The next fresh id (not live, `skip(id)` false) without using it up, so a refused
        persist consumes none; put(cid=...) then claim_id(cid) take it."""
        n = self._next_id
        while True:
            cid = f"c{n:04d}"
            if cid not in self.caps and not skip(cid):
                return cid
            n += 1

    def claim_id(self, cid: str) -> None:
        """Let new_id() continue after `cid` (an id given to put), so ids are never reissued."""
        if cid[:1] == "c" and cid[1:].isdigit():
            self.skip_ids_below(int(cid[1:]) + 1)

    def next_number(self) -> int:
        """The number the next fresh id starts from (c0007: 7)."""
        return self._next_id

    def skip_ids_below(self, n: int) -> None:
        """Issue no id numbered below `n` from now on (a node's earlier engines issued them),
        reserving more on disk when the counter reaches the reserved limit."""
        n = self._next_id = max(self._next_id, n)
        if self.reserve is not None and n >= self.reserved_to:
            self.reserved_to = self.reserve(n)
