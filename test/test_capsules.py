"""Capsules on the CPU: byte-exact restore, branch, rollback, the pool, and the KV-only ablation
of "Execution-State Capsules" (arXiv 2606.20537)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashrt_ros.errors import BadRequest, CapacityError, CorruptCapsule
from flashrt_ros.runtime.recipes import restore_regions, rollback
from test.engine_util import make_engine, observations

OBS = observations(500, seed=11)


def run(eng, obs, session="main"):
    return np.array([eng.step(o, session=session) for o in obs])


def warmed(**kw):
    eng = make_engine(**kw)
    run(eng, OBS[:100])
    return eng


def test_checkpoint_restore_continuation_is_identical():
    eng = warmed()
    at_cp = eng.state_bytes()
    cap = eng.checkpoint(name="before")
    assert cap.step == 100 and cap.session == "main" and cap.tier == "cpu"
    assert cap.nbytes == eng.state_nbytes and len(cap.checksum) == 32
    first = run(eng, OBS[100:300])
    assert eng.restore(cap.id).id == cap.id
    assert eng.state_bytes() == at_cp
    assert eng.session_step() == 100
    assert eng.state_checksum() == cap.checksum
    second = run(eng, OBS[100:300])
    assert np.array_equal(first, second)


def test_restore_by_name_and_rollback():
    eng = warmed()
    eng.checkpoint(name="older")
    run(eng, OBS[100:120])
    newest = eng.checkpoint()
    expect = run(eng, OBS[120:150])
    assert rollback(eng).id == newest.id
    assert np.array_equal(run(eng, OBS[120:150]), expect)
    eng.restore("older")
    assert eng.session_step() == 100
    eng.create_session("alt")
    with pytest.raises(ValueError, match="no capsule"):
        rollback(eng, "alt")


def test_branch_continues_like_the_live_session_and_never_disturbs_it():
    eng = warmed()
    cap = eng.checkpoint()
    eng.branch(cap.id, "alt")
    assert eng.session_step("alt") == 100
    assert eng.session("alt").parent_id == cap.id
    main_before = eng.state_bytes("main")
    alt = run(eng, OBS[100:300], session="alt")
    assert eng.state_bytes("main") == main_before  # stepping a branch leaves main alone
    live = run(eng, OBS[100:300])
    assert np.array_equal(alt, live)


def test_branch_with_new_goal_diverges_and_overwrite_works():
    eng = warmed()
    cap = eng.checkpoint()
    eng.branch(cap.id, "alt", goal=[0.3] * 6)
    assert np.allclose(eng.get_goal("alt"), 0.3)
    a = run(eng, OBS[100:150], session="alt")
    eng.branch(cap.id, "alt")  # overwrite: back to the capsule's goal
    b = run(eng, OBS[100:150], session="alt")
    c = run(eng, OBS[100:150])
    assert np.array_equal(b, c) and not np.array_equal(a, c)
    n = len(eng.sessions())
    with pytest.raises(ValueError):
        eng.branch(cap.id, "new_one", goal=[1.0] * 5)
    assert len(eng.sessions()) == n  # bad goal: no session created


def test_restore_while_another_session_steps():
    eng = warmed()
    cap = eng.checkpoint()
    eng.branch(cap.id, "alt")
    first = []
    for o in OBS[100:200]:
        first.append(eng.step(o))
        eng.step(OBS[0], session="alt")
    eng.restore(cap.id)
    second = []
    for i, o in enumerate(OBS[100:200]):
        eng.step(OBS[i], session="alt")
        second.append(eng.step(o))
    assert np.array_equal(np.array(first), np.array(second))


def test_ablation_kv_only_restore_diverges_full_restore_does_not():
    """The paper's claim: recurrent, conv, queue and noise state are load-bearing."""
    eng = warmed()
    cap = eng.checkpoint()
    reference = run(eng, OBS[100:200])
    restore_regions(eng, cap.id, "main", ("kv",))
    kv_only = run(eng, OBS[100:200])
    assert not np.array_equal(kv_only, reference)
    assert np.abs(kv_only - reference).max() > 1e-4
    eng.restore(cap.id)
    assert np.array_equal(run(eng, OBS[100:200]), reference)


def test_lru_eviction_order_and_pinning():
    eng = warmed(capsule_slots=3)
    a = eng.checkpoint(name="a")
    b = eng.checkpoint(name="b", pin=True)
    c = eng.checkpoint(name="c")
    eng.restore("a")  # a is now more recent than c
    d = eng.checkpoint(name="d")
    ids = {i.id for i in eng.capsules()}
    assert ids == {a.id, b.id, d.id}  # c was least recently used
    e = eng.checkpoint(name="e")  # evicts a (b is pinned)
    assert {i.id for i in eng.capsules()} == {b.id, d.id, e.id}
    eng.pin("d")
    eng.pin("e")
    before = eng.capsules()
    with pytest.raises(CapacityError, match="pinned"):
        eng.checkpoint(name="f")
    assert eng.capsules() == before
    with pytest.raises(ValueError):
        eng.restore(c.id)


def test_host_spill_keeps_evicted_capsules_restorable():
    eng = warmed(capsule_slots=2, host_capsule_slots=2)
    first = eng.checkpoint(name="first")
    expect = run(eng, OBS[100:160])
    eng.checkpoint(name="second")
    eng.checkpoint(name="third")  # spills "first" to the host tier
    tiers = {i.name: i.tier for i in eng.capsules()}
    assert tiers == {"first": "host", "second": "cpu", "third": "cpu"}
    assert eng.restore("first").checksum == first.checksum
    assert np.array_equal(run(eng, OBS[100:160]), expect)
    eng.checkpoint(name="fourth")
    eng.checkpoint(name="fifth")  # host tier full: the least recently used of all is dropped
    tiers = {i.name: i.tier for i in eng.capsules()}
    assert tiers == {"first": "host", "third": "host", "fourth": "cpu", "fifth": "cpu"}


def test_eviction_keeps_the_lru_order_across_tiers():
    """A capsule just restored from the host tier is recent: when the host tier is full, the
    least recently used capsule of both tiers goes, not the host tier's."""
    eng = warmed(capsule_slots=2, host_capsule_slots=1)
    eng.checkpoint(name="a")
    eng.checkpoint(name="b")
    eng.checkpoint(name="c")  # a spills to the host tier
    eng.restore("a")  # now the most recently used
    eng.checkpoint(name="d")  # b, the least recently used, goes; a stays in the host tier
    assert {i.name: i.tier for i in eng.capsules()} == {"a": "host", "c": "cpu", "d": "cpu"}


def test_pinning_a_host_tier_capsule_brings_it_back_to_a_slot():
    eng = warmed(capsule_slots=2, host_capsule_slots=1)
    a = eng.checkpoint(name="a")
    expect = run(eng, OBS[100:140])
    eng.checkpoint(name="b")
    eng.checkpoint(name="c")  # a spills to the host tier
    assert eng.capsule("a").tier == "host"
    info = eng.pin("a")  # b (least recently used) gives its slot and spills into a's host row
    assert info.pinned and info.tier == "cpu" and info.checksum == a.checksum
    assert {i.name: i.tier for i in eng.capsules()} == {"a": "cpu", "b": "host", "c": "cpu"}
    assert eng.restore("b").tier == "host"  # the spilled one is whole
    eng.restore("a")  # verify=True: the promoted bytes are the checkpoint's
    assert np.array_equal(run(eng, OBS[100:140]), expect)
    eng.pin("c")
    before = eng.capsules()
    with pytest.raises(CapacityError, match="pinned"):  # every slot pinned: nothing moves
        eng.pin("b")
    assert eng.capsules() == before


@pytest.mark.parametrize(
    "name", ["../escape", "a/b", ".hidden", "-dash", "x" * 65, "sp ace", "é", "a\x00b"]
)
def test_bad_capsule_names_are_refused(name):
    eng = warmed()
    with pytest.raises(ValueError, match="capsule name"):
        eng.checkpoint(name=name)
    assert eng.capsules() == []


def test_duplicate_names_unknown_ids_and_drop():
    eng = warmed()
    cap = eng.checkpoint(name="home")
    with pytest.raises(ValueError, match="taken"):
        eng.checkpoint(name="home")
    before = eng.state_bytes()
    for bad in ("nope", "", "c9999", None, ["home"]):
        with pytest.raises(BadRequest):
            eng.restore(bad)
        with pytest.raises(BadRequest):
            eng.branch(bad, "alt")
        with pytest.raises(BadRequest):
            eng.drop(bad)
    assert eng.state_bytes() == before and "alt" not in eng.sessions()
    assert eng.drop("home").id == cap.id
    assert eng.capsules() == []
    with pytest.raises(ValueError):
        eng.restore(cap.id)


def test_verify_detects_a_corrupted_capsule_and_changes_nothing():
    eng = warmed()
    cap = eng.checkpoint()
    run(eng, OBS[100:110])
    before = eng.state_bytes()
    slot = eng.pool.get(cap.id).slot
    eng.pool.slab[slot, 17] ^= 0x40
    with pytest.raises(CorruptCapsule, match="corrupted"):
        eng.restore(cap.id, verify=True)
    assert eng.state_bytes() == before
    assert eng.session_step() == 110


def test_fingerprint_mismatch_is_refused(tmp_path):
    eng = warmed()
    cap = eng.checkpoint()
    path = eng.save_capsule(cap.id, tmp_path / "x.fcap")
    other = make_engine(policy="test.engine_util:tiny_policy")
    with pytest.raises(ValueError, match="fingerprint"):
        other.load_capsule(path)
    assert other.capsules() == []


def test_checksum_fills_the_given_buffer_and_sees_one_flipped_bit():
    from flashrt_ros.capsules.checksum import device_checksum, reference_digest, to_hex

    buf = torch.randint(0, 256, (4096 + 12,), dtype=torch.uint8, generator=torch.Generator())
    out = torch.zeros(2, dtype=torch.int64)
    got = device_checksum(buf, out=out)
    assert got is out and torch.equal(out, reference_digest(buf))
    before = to_hex(out)
    buf[777] ^= 4
    assert to_hex(device_checksum(buf)) != before
    buf[777] ^= 4
    swapped = buf.clone()
    swapped[:4], swapped[4:8] = buf[4:8].clone(), buf[:4].clone()  # same words, moved
    assert to_hex(device_checksum(buf)) == before != to_hex(device_checksum(swapped))
    with pytest.raises(ValueError, match="multiple of 4"):
        device_checksum(buf[:7])


# -- checkpoint: one probe pass (finite flags + checksum), one readback ---------------------------
def _reference_hex(buf) -> str:
    from flashrt_ros.capsules.checksum import reference_digest, to_hex

    return to_hex(reference_digest(buf))


def test_checkpoint_checksum_is_the_reference_digest_of_the_arena_and_of_the_slot(tmp_path):
    """The probe's digest goes to the slot's digest row by a copy: it must be exactly the
    digest of the slot's bytes (restore's verify compares against it), and its hex the info's,
    the persisted file's and the one a new computation gives."""
    from flashrt_ros.capsules.checksum import reference_digest

    eng = warmed(capsule_dir=tmp_path)
    eng.create_session("alt")
    run(eng, OBS[:37], session="alt")
    for session, persist in (("main", False), ("alt", True), ("main", True)):
        state = eng.session(session).arena.buf.clone()
        cap = eng.checkpoint(session, persist=persist)
        assert cap.checksum == _reference_hex(state) == eng.state_checksum(session)
        pc = eng.pool.get(cap.id)
        assert pc.digest.data_ptr() == eng.pool.digests[pc.slot].data_ptr()  # the slot's row
        assert torch.equal(pc.digest, reference_digest(eng.pool.slab[pc.slot]))
        assert torch.equal(pc.digest, reference_digest(state))
        if persist:
            header, payload = eng.store.read(tmp_path / f"{cap.id}.fcap")  # checks the checksum
            assert header["checksum"] == cap.checksum and bytes(payload) == bytes(state.numpy())
        run(eng, OBS[100:103], session=session)  # the next checkpoint sees another state
    assert len({c.checksum for c in eng.capsules()}) == 3


def test_checkpoint_computes_the_checksum_once_and_never_reads_it_back_again(monkeypatch, tmp_path):
    """One pass: the probe's digest is the only checksum a checkpoint computes (the pool copies
    it), and its hex comes from the probe's readback (the pool's lazy to_hex never runs), with
    persist too. On CUDA this is what makes a checkpoint one launch and one wait."""
    from flashrt_ros.capsules import pool as pool_mod
    from flashrt_ros.runtime import engine as engine_mod
    from flashrt_ros.runtime import probe as probe_mod

    eng = warmed(capsule_dir=tmp_path)
    eng.checkpoint()  # main's probe exists from the start; "alt"'s is made below on first use
    eng.create_session("alt")
    calls: list[str] = []
    real = probe_mod.device_checksum

    def counted(buf, out=None):
        calls.append("probe")
        return real(buf, out=out)

    def forbidden(*_a, **_k):
        raise AssertionError("a checkpoint computed or read back the checksum a second time")

    monkeypatch.setattr(probe_mod, "device_checksum", counted)
    monkeypatch.setattr(pool_mod, "device_checksum", forbidden)
    monkeypatch.setattr(pool_mod, "to_hex", forbidden)
    monkeypatch.setattr(engine_mod, "to_hex", forbidden)
    for session, kw in (
        ("alt", {}),
        ("main", {}),
        ("main", {"persist": True, "name": "kept"}),
        ("alt", {"persist": True, "pin": True}),
    ):
        calls.clear()
        eng.checkpoint(session, **kw)
        assert calls == ["probe"], (session, kw)
    assert all(len(c.checksum) == 32 for c in eng.capsules())


def test_a_nan_refusal_changes_nothing_not_even_the_next_id(tmp_path):
    eng = warmed(capsule_dir=tmp_path, capsule_slots=2)
    s = eng.session("main")
    before, free, slab = eng.state_bytes(), eng.pool.free_slots(), eng.pool.slab.clone()
    for region, bad in (
        ("goal", math.inf),
        ("goal", -math.inf),
        ("goal", math.nan),
        ("k1", math.nan),  # inside the span of k0..queue (Arena.float_spans)
        ("queue", math.inf),
    ):
        v = s.views[region]
        old = v.clone()
        v.view(-1)[0] = bad
        for kw in ({}, {"persist": True}, {"persist": True, "name": "x"}, {"pin": True}):
            with pytest.raises(BadRequest, match=f"'main' holds NaN or Inf in {region}; refusing"):
                eng.checkpoint(**kw)
        v.copy_(old)
    assert eng.state_bytes() == before and eng.session_step() == 100
    assert eng.capsules() == [] and eng.pool.free_slots() == free
    files = lambda: sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".flashrt."))  # noqa: E731
    assert torch.equal(eng.pool.slab, slab) and files() == []
    cap = eng.checkpoint(persist=True)  # once finite again it works, with the first id
    assert cap.id == "c0001" and files() == ["c0001.fcap"]


def test_restore_verify_after_checkpoint_passes_and_catches_corruption_in_either_tier():
    """The digest row a checkpoint stores (the probe's, copied) is what verify compares: a
    clean restore passes, one flipped bit in the slot or in the spilled host copy is caught."""
    eng = warmed(capsule_slots=1, host_capsule_slots=1)
    first = eng.checkpoint(name="first")
    at_first = eng.state_bytes()
    run(eng, OBS[100:120])
    second = eng.checkpoint(name="second")  # spills "first" to the host tier (digest cloned)
    at_second = eng.state_bytes()
    assert {i.name: i.tier for i in eng.capsules()} == {"first": "host", "second": "cpu"}
    run(eng, OBS[120:130])
    assert eng.restore("first", verify=True).checksum == first.checksum
    assert eng.state_bytes() == at_first
    assert eng.restore("second", verify=True).checksum == second.checksum
    assert eng.state_bytes() == at_second
    for cap in (eng.pool.get("second"), eng.pool.get("first")):
        src = eng.pool.source(cap)
        src[-5] ^= 1
        run(eng, OBS[130:131])
        before = eng.state_bytes()
        with pytest.raises(CorruptCapsule, match=cap.info.id):
            eng.restore(cap.info.id, verify=True)
        assert eng.state_bytes() == before
        src[-5] ^= 1
        eng.restore(cap.info.id, verify=True)


def test_a_session_made_again_under_its_name_gets_a_new_probe():
    eng = warmed()
    eng.create_session("alt")
    eng.checkpoint("alt")
    old = eng._probes["alt"]
    eng.drop_session("alt")
    assert "alt" not in eng._probes
    alt = eng.create_session("alt")
    run(eng, OBS[:5], session="alt")
    cap = eng.checkpoint("alt")
    assert eng._probes["alt"] is not old and eng._probes["alt"].session is alt
    assert cap.checksum == _reference_hex(alt.arena.buf) and cap.step == 5


def test_pool_put_copies_a_given_digest_and_computes_one_otherwise():
    """pool.put's contract for its other callers (reload, checkpoint_at, rewind's keep): without
    a digest it computes the slot's; with one it copies it; a wrong size is refused before a
    slot is taken (nobody evicted)."""
    import torch

    from flashrt_ros.capsules.checksum import hex_of, reference_digest
    from flashrt_ros.capsules.pool import CapsulePool

    pool = CapsulePool(64, torch.device("cpu"), slots=1)
    src = torch.arange(64, dtype=torch.uint8)
    ref = reference_digest(src)
    a = pool.put(src, session="s", parent_id="", step=1)
    assert torch.equal(a.digest, ref) and pool.info(a).checksum == hex_of(ref.tolist())
    with pytest.raises(ValueError, match="64 bytes"):
        pool.put(src[:60], session="s", parent_id="", step=2)
    with pytest.raises(ValueError, match="digest"):
        pool.put(src, session="s", parent_id="", step=2, digest=ref[:1])
    assert list(pool.caps) == [a.info.id]  # not evicted by the refused puts
    b = pool.put(src, session="s", parent_id="", step=3, digest=ref.clone(), checksum="ab" * 16)
    assert a.info.id not in pool.caps  # LRU eviction made room
    assert torch.equal(b.digest, ref) and b.info.checksum == "ab" * 16
    assert b.digest.data_ptr() == pool.digests[b.slot].data_ptr()
    assert pool.matches(b, src)


def test_float_spans_cover_neighbouring_regions_and_padding_is_no_state():
    """The probe checks floating-point regions a span at a time (neighbours of one dtype with
    their alignment padding); NaN bytes in that padding (say from a capsule file) are no state
    of the policy: the checkpoint goes on, while NaN in a region is refused naming it."""
    from flashrt_ros import Engine, load_policy

    eng = Engine(load_policy("test.tiny_policy:tiny"), device="cpu")
    s = eng.session("main")
    rows = {r.name: r for r in s.arena.rows}
    spans = s.arena.float_spans(["last", "goal"])
    assert len(spans) == 1  # last (24 B), 232 B of padding, goal: one view
    assert spans[0].numel() * 4 == rows["goal"].offset + rows["goal"].nbytes
    hybrid = Engine(load_policy("builtin:hybrid"), device="cpu").session("main").arena
    floats = [r.name for r in hybrid.rows if r.dtype.startswith("float")]
    assert len(floats) == 8 and len(hybrid.float_spans(floats)) == 2  # rng (int64) splits them
    pad = rows["last"].offset + rows["last"].nbytes  # the first padding byte
    nan = np.array([np.nan], np.float32).view(np.uint8)
    s.arena.buf[pad : pad + 4] = torch.from_numpy(nan.copy())
    cap = eng.checkpoint(name="padding")  # the padding is no state: nothing refused
    assert cap.name == "padding"
    s.views["last"].view(-1)[1] = math.nan
    with pytest.raises(BadRequest, match="holds NaN or Inf in last; refusing"):
        eng.checkpoint()


def test_a_slot_filled_by_its_caller_is_adopted_with_bookkeeping_only():
    """The pool's side of a checkpoint whose pass fills a free slot itself (on CUDA, the
    probe's graph): adopt() records the capsule without copying, and it restores verified; a
    slot that is not free, or a name that is taken, is refused with nothing changed."""
    from flashrt_ros.capsules.checksum import device_checksum, to_hex
    from flashrt_ros.errors import BadName

    eng = warmed(capsule_slots=3)
    pool, s = eng.pool, eng.session("main")
    eng.checkpoint(name="taken")
    slot = pool.free_slot()
    assert slot is not None and slot in pool.free
    pool.slab[slot].copy_(s.arena.buf)  # what the pass does: the bytes, then the digest row
    digest = device_checksum(s.arena.buf)
    pool.digest_row(slot).copy_(digest.view(torch.uint8))
    before = (list(pool.free), sorted(pool.caps))
    with pytest.raises(BadName):
        pool.adopt(slot, name="taken", session="main", parent_id="", step=s.steps)
    busy = next(c.slot for c in pool.caps.values())
    with pytest.raises(ValueError):
        pool.adopt(busy, session="main", parent_id="", step=s.steps)
    assert (list(pool.free), sorted(pool.caps)) == before
    cap = pool.adopt(slot, session="main", parent_id="", step=s.steps, checksum=to_hex(digest))
    assert cap.slot == slot and slot not in pool.free
    want = eng.step(observations(1, seed=4)[0])
    info = eng.restore(cap.info.id, verify=True)  # the digest row is the slot's bytes' digest
    assert info.checksum == to_hex(digest) == eng.state_checksum()
    assert np.array_equal(eng.step(observations(1, seed=4)[0]), want)


def test_an_id_picked_before_the_pass_is_used_up_only_by_adopt():
    """The kernels' checkpoint picks its capsule's id (peek_id) while the pass runs and hands
    it to adopt(): peeking uses nothing up (a refused state leaves the counter as it was),
    adopt uses it up (a dropped capsule's id is never issued again), and an id a live capsule
    holds is refused with nothing changed."""
    from flashrt_ros.errors import BadRequest

    eng = warmed(capsule_slots=3)
    pool, s = eng.pool, eng.session("main")
    first = eng.checkpoint()
    cid = pool.peek_id(pool.id_taken)
    assert pool.peek_id(pool.id_taken) == cid  # peeking twice: the same id, none used up
    slot = pool.free_slot()
    before = (list(pool.free), sorted(pool.caps), pool.next_number())
    with pytest.raises(BadRequest, match="taken"):
        pool.adopt(slot, session="main", parent_id="", step=s.steps, cid=first.id)
    assert (list(pool.free), sorted(pool.caps), pool.next_number()) == before
    cap = pool.adopt(slot, session="main", parent_id="", step=s.steps, cid=cid, stamp=12.5)
    assert (cap.info.id, cap.info.stamp) == (cid, 12.5)
    eng.drop(cid)  # used up: never issued again, though no live capsule holds it now
    assert pool.peek_id(pool.id_taken) != cid and eng.checkpoint().id != cid


@pytest.mark.exclusive
def test_a_planner_thread_checkpoints_while_another_thread_steps():
    """Each capsule a second thread takes while the first steps is a state the steps passed
    through (its checksum is the single-threaded run's at its step), and a branch from it holds
    exactly those bytes: every public call runs whole, between two steps (runtime/calls.py).
    Unserialized, capsules were taken mid-step: they loaded cleanly and continued wrongly."""
    import threading
    import time

    obs = observations(150, seed=4)
    ref = make_engine()
    want = {0: ref.state_checksum()}
    for i, o in enumerate(obs):
        ref.step(o)
        want[i + 1] = ref.state_checksum()
    eng = make_engine(capsule_slots=4)
    done = threading.Event()

    def steps() -> None:
        for o in obs:
            eng.step(o)
            time.sleep(0)  # the GIL to the other thread: without it that one could starve
        done.set()

    stepper = threading.Thread(target=steps)
    stepper.start()
    taken = []
    while not done.is_set():
        info = eng.checkpoint()
        taken.append((info.step, info.checksum))
        eng.branch(info.id, "alt")
        assert eng.state_checksum("alt") == info.checksum
    stepper.join()
    assert len(taken) > 20, len(taken)
    assert [c for _, c in taken] == [want[s] for s, _ in taken]
    assert eng.state_checksum() == want[len(obs)]
