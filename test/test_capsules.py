"""Capsules on the CPU: byte-exact restore, branch, rollback, the pool, and the KV-only ablation
of "Execution-State Capsules" (arXiv 2606.20537)."""

from __future__ import annotations

import numpy as np
import pytest

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
    eng.checkpoint(name="fifth")  # host tier full: its oldest is dropped
    assert len(eng.capsules()) == 4
    host_one = next(i for i in eng.capsules() if i.tier == "host")
    with pytest.raises(ValueError, match="host tier"):
        eng.pin(host_one.id)


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
    import torch

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
