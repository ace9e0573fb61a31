"""The disk tier: atomic files, reload in a new engine, and every kind of bad file refused."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from flashrt_ros.capsules import diskfmt
from flashrt_ros.errors import BadName, UnknownReference
from test.engine_util import make_engine, observations

OBS = observations(300, seed=21)


def run(eng, obs):
    return np.array([eng.step(o) for o in obs])


@pytest.fixture()
def saved(tmp_path):
    eng = make_engine()
    run(eng, OBS[:100])
    cap = eng.checkpoint(name="ready")
    expect = run(eng, OBS[100:250])
    path = eng.save_capsule(cap.id, tmp_path / "ready.fcap")
    return path, cap, expect


def test_saved_capsule_continues_identically_in_a_new_engine(saved):
    path, cap, expect = saved
    fresh = make_engine()
    info = fresh.load_capsule(path)
    assert (info.name, info.step, info.checksum, info.id) == ("ready", 100, cap.checksum, cap.id)
    fresh.restore("ready")
    assert np.array_equal(run(fresh, OBS[100:250]), expect)
    assert not list(path.parent.glob(".*tmp*"))  # no temp file left behind


def test_capsule_dir_persists_and_reloads(tmp_path):
    eng = make_engine(capsule_dir=tmp_path)
    run(eng, OBS[:50])
    eng.checkpoint(name="kept", persist=True)
    eng.checkpoint(name="volatile")
    expect = run(eng, OBS[50:120])
    (tmp_path / "junk.fcap").write_bytes(b"garbage")  # skipped with a warning, not fatal
    again = make_engine(capsule_dir=tmp_path)
    assert [i.name for i in again.capsules()] == ["kept"]
    again.restore("kept")
    assert np.array_equal(run(again, OBS[50:120]), expect)
    again.drop("kept")
    assert not (tmp_path / "kept.fcap").exists()
    with pytest.raises(ValueError, match="capsule_dir"):
        make_engine().checkpoint(name="x", persist=True)


def test_an_evicted_persisted_capsule_is_named_by_its_file(tmp_path):
    """A persisted capsule evicted from a full pool keeps its file; asking for it says so and
    how to get it back (it only said "unknown capsule"; review), and load_capsule does."""
    eng = make_engine(capsule_dir=tmp_path, capsule_slots=2)
    run(eng, OBS[:5])
    eng.checkpoint(name="grasp", persist=True)
    for i in range(2):
        run(eng, OBS[5 + i : 6 + i])
        eng.checkpoint()
    assert "grasp" not in [i.name for i in eng.capsules()]
    before = eng.state_bytes()
    with pytest.raises(ValueError, match=r"capsule_dir holds grasp\.fcap.*Engine\.load_capsule"):
        eng.restore("grasp")
    with pytest.raises(ValueError, match=r"^unknown capsule 'nothing' \(list_capsules[^;]*$"):
        eng.restore("nothing")  # no file: no hint
    assert eng.state_bytes() == before
    eng.load_capsule(tmp_path / "grasp.fcap")
    eng.restore("grasp")


def _mutations(data: bytes):
    hlen = struct.unpack("<I", data[12:16])[0]
    header = json.loads(data[16 : 16 + hlen])
    bad_nbytes = dict(header, nbytes=header["nbytes"] + 4)
    hb = json.dumps(bad_nbytes).encode()
    return {
        "truncated": data[:-100],
        "truncated_header": data[: 16 + hlen // 2],
        "trailing": data + b"\x00",
        "payload_bit_flip": data[:-200] + bytes([data[-200] ^ 1]) + data[-199:],
        "digest_flip": data[:-1] + bytes([data[-1] ^ 1]),
        "bad_magic": b"NOTCAPS\x00" + data[8:],
        "bad_version": data[:8] + struct.pack("<I", 99) + data[12:],
        "huge_header_len": data[:12] + struct.pack("<I", 1 << 30) + data[16:],
        "header_not_json": data[:16] + b"{" * hlen + data[16 + hlen :],
        "header_fields": data[:12] + struct.pack("<I", len(hb)) + hb + data[16 + hlen :],
        "empty": b"",
        "foreign": b"PK\x03\x04" + bytes(range(256)) * 10,
    }


KINDS = [
    "truncated",
    "truncated_header",
    "trailing",
    "payload_bit_flip",
    "digest_flip",
    "bad_magic",
    "bad_version",
    "huge_header_len",
    "header_not_json",
    "header_fields",
    "empty",
    "foreign",
]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_files_are_refused_and_change_nothing(saved, tmp_path, kind):
    path, _, _ = saved
    bad = tmp_path / f"{kind}.fcap"
    bad.write_bytes(_mutations(path.read_bytes())[kind])
    eng = make_engine()
    run(eng, OBS[:10])
    before = eng.state_bytes()
    with pytest.raises(ValueError):
        eng.load_capsule(bad)
    assert eng.capsules() == [] and eng.state_bytes() == before


def test_missing_file_and_folder(tmp_path, saved):
    eng = make_engine()
    with pytest.raises(ValueError, match="cannot read"):
        eng.load_capsule(tmp_path / "none.fcap")
    cap = eng.checkpoint()
    with pytest.raises(ValueError, match="does not exist"):
        eng.save_capsule(cap.id, tmp_path / "no" / "dir.fcap")


def test_payload_checksum_mismatch_with_valid_digest(saved, tmp_path):
    """A file rewritten with a consistent digest but altered state is still refused."""
    path, _, _ = saved
    header, payload = diskfmt.read_capsule_file(path)
    tampered = bytearray(payload)
    tampered[5] ^= 0xFF
    out = diskfmt.write_capsule_file(tmp_path / "tampered.fcap", header, bytes(tampered))
    with pytest.raises(ValueError, match="checksum"):
        make_engine().load_capsule(out)


def test_load_refuses_a_taken_name(saved):
    path, _, _ = saved
    eng = make_engine()
    eng.load_capsule(path)
    with pytest.raises(ValueError, match="taken"):
        eng.load_capsule(path)
    assert eng.load_capsule(path, name="ready2").name == "ready2"


def test_failed_persist_changes_nothing(tmp_path):
    d = tmp_path / "caps"
    d.mkdir()
    eng = make_engine(capsule_slots=2, capsule_dir=d)
    run(eng, OBS[:5])
    eng.checkpoint(name="a")
    eng.checkpoint(name="b")  # the pool is full: a new capsule would evict "a"
    before = eng.capsules()
    shutil.rmtree(d)  # the folder goes (it holds the ids' reserve, id_reserve.py)
    with pytest.raises(ValueError, match="does not exist"):
        eng.checkpoint(name="x", persist=True)
    assert eng.capsules() == before


@pytest.mark.parametrize(
    "field,value",
    [
        ("id", "../../tmp/victim"),
        ("session", "a/b"),
        ("parent_id", "../x"),
        ("name", "-x"),
        ("stamp", float("nan")),
        ("step", 2**64),
    ],
)
def test_forged_header_fields_are_refused(saved, tmp_path, field, value):
    path, _, _ = saved
    header, payload = diskfmt.read_capsule_file(path)
    header[field] = value
    forged = diskfmt.write_capsule_file(tmp_path / "forged.fcap", header, payload)
    eng = make_engine()
    with pytest.raises(ValueError, match=field if field != "step" else "bounds"):
        eng.load_capsule(forged)
    assert eng.capsules() == []


def test_persisted_ids_never_overwrite_files_and_drop_removes_only_its_own(tmp_path):
    (tmp_path / "c0001.fcap").write_bytes(b"somebody else's")
    (tmp_path / "loose.fcap").write_bytes(b"not ours either")
    eng = make_engine(capsule_dir=tmp_path)
    info = eng.checkpoint(persist=True)
    assert info.id != "c0001" and (tmp_path / f"{info.id}.fcap").exists()
    assert (tmp_path / "c0001.fcap").read_bytes() == b"somebody else's"
    with pytest.raises(BadName, match="loose.fcap exists in capsule_dir and holds the name"):
        eng.checkpoint(name="loose")  # the file holds the name, whatever is in it
    assert (tmp_path / "loose.fcap").read_bytes() == b"not ours either"
    eng.drop(info.id)
    assert not (tmp_path / f"{info.id}.fcap").exists()


def test_a_drop_never_deletes_a_file_that_holds_another_capsule_by_now(tmp_path, caplog):
    """Two nodes of one policy share a capsule_dir: B loaded A's 'grasp', A dropped it and
    persisted a new 'grasp' (same file name). B's drop of its stale copy deleted A's new file,
    which A still listed and would have lost at its next start."""
    a = make_engine(capsule_dir=tmp_path)
    run(a, OBS[:3])
    a.checkpoint(name="grasp", persist=True)
    b = make_engine(capsule_dir=tmp_path)  # starts later: reloads grasp.fcap
    assert [c.name for c in b.capsules()] == ["grasp"]
    a.drop("grasp")
    run(a, OBS[3:8])
    new = a.checkpoint(name="grasp", persist=True)
    file = tmp_path / "grasp.fcap"
    assert diskfmt.read_capsule_header(file)["stamp"] == new.stamp
    with caplog.at_level("WARNING", logger="flashrt_ros.capsules.store"):
        b.drop("grasp")
    assert file.exists() and diskfmt.read_capsule_header(file)["stamp"] == new.stamp
    assert "left in place: it no longer holds capsule" in caplog.text
    assert [c.name for c in b.capsules()] == []  # B's copy is gone from its pool all the same
    a.drop("grasp")  # A's own drop still removes its own file
    assert not file.exists()


def test_a_missing_capsule_dir_is_created_and_a_file_in_its_place_refused(tmp_path):
    """A fresh robot has no capsule folder yet: the start made the node exit 2 ("is not a
    folder") while its flight dumps create theirs. A file where the folder should be is still
    refused, as is a folder that cannot be made."""
    d = tmp_path / "robot" / "capsules"
    eng = make_engine(capsule_dir=d)
    assert d.is_dir() and eng.capsules() == []
    info = eng.checkpoint(name="first", persist=True)
    assert (d / "first.fcap").exists() and info.name == "first"
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="not a folder"):
        make_engine(capsule_dir=tmp_path / "afile")
    with pytest.raises(ValueError, match="cannot create capsule_dir"):
        make_engine(capsule_dir=tmp_path / "afile" / "below")


def _reload_at(d, gate, out) -> None:
    from flashrt_ros.capsules.store import CapsuleStore

    store = CapsuleStore(d, fingerprint="x", layout=[], nbytes=8, policy_id="p")
    gate.wait()
    try:
        store.reload(lambda path: None, lambda: 1)
        out.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(f"{type(e).__name__}: {e}")


def test_two_nodes_making_one_missing_capsule_dir_at_once_both_start(tmp_path):
    """Two nodes sharing a capsule_dir that does not exist yet start together: whichever makes
    it second must take it as made (it failed configure with 'File exists' in 115 of 200
    rounds of a review's race)."""
    import multiprocessing

    mp = multiprocessing.get_context("fork")
    for r in range(30):
        d = tmp_path / f"r{r}" / "capsules"
        gate, out = mp.Barrier(2), mp.Queue()
        procs = [mp.Process(target=_reload_at, args=(d, gate, out)) for _ in range(2)]
        for p in procs:
            p.start()
        got = [out.get(timeout=30), out.get(timeout=30)]
        for p in procs:
            p.join()
        assert got == ["ok", "ok"] and d.is_dir(), (r, got)


def test_an_evicted_persisted_capsule_keeps_its_name_held(tmp_path):
    """A persisted 'x' evicted from a full pool left its name free: a plain checkpoint took
    'x' at another step, and after a restart (or a load of x.fcap) 'x' meant the old state. The
    file holds the name until it goes; loading that file gives it back, and its drop frees it."""
    eng = make_engine(capsule_slots=2, capsule_dir=tmp_path)
    run(eng, OBS[:1])
    old = eng.checkpoint(name="x", persist=True)
    run(eng, OBS[1:3])
    eng.checkpoint()
    eng.checkpoint()  # x is evicted; x.fcap stays
    assert "x" not in [c.name for c in eng.capsules()]
    for call in (lambda: eng.checkpoint(name="x"), lambda: eng.checkpoint(name="x", persist=True)):
        with pytest.raises(BadName, match="x.fcap exists in capsule_dir and holds the name 'x'"):
            call()
    back = eng.load_capsule(tmp_path / "x.fcap", name="x")  # its own name, said again
    assert back.name == "x" and back.step == old.step and back.checksum == old.checksum
    eng.drop("x")  # removes x.fcap: the name is free again
    assert not (tmp_path / "x.fcap").exists()
    assert eng.checkpoint(name="x").step == 3


def test_a_file_copied_in_under_another_name_never_takes_an_issued_id(tmp_path):
    """Another robot's c0001, copied into capsule_dir as from_robot2.fcap, kept its id at the
    next start although this folder's first run had issued c0001 (not persisted) to its own
    planner: restore('c0001') then brought another robot's state. At the start's reload only a
    file under the name a persist gives it keeps an id; this one comes back under a fresh id.
    A persisted capsule of the earlier run keeps its id across the restart."""
    mine = tmp_path / "mine"
    other = tmp_path / "other"
    a = make_engine(capsule_dir=mine)
    run(a, OBS[:2])
    issued = a.checkpoint()  # c0001, kept by a planner, never persisted
    kept = a.checkpoint(name="kept", persist=True)
    del a
    b = make_engine(capsule_dir=other)
    run(b, OBS[:7])
    foreign = b.checkpoint(persist=True)
    assert foreign.id == issued.id == "c0001"
    (mine / "from_robot2.fcap").write_bytes((other / "c0001.fcap").read_bytes())
    del b
    again = make_engine(capsule_dir=mine)
    by_id = {c.id: c for c in again.capsules()}
    assert "c0001" not in by_id
    assert by_id[kept.id].name == "kept" and by_id[kept.id].checksum == kept.checksum
    [copied] = [c for c in again.capsules() if c.checksum == foreign.checksum]
    assert copied.id not in (issued.id, kept.id) and copied.step == 7
    with pytest.raises(UnknownReference):
        again.restore("c0001")


def test_a_file_copied_in_under_its_own_name_never_takes_an_issued_id(tmp_path):
    """Robot A's grasp.fcap (c0001 there), copied unchanged into robot B's capsule_dir, where
    c0001 was issued for another state that B's planner still holds: at B's next start the file
    is A's (another folder's token in its header) and comes back under a fresh id. B's own
    persisted file, copied out and back under its name, is still B's and keeps its id."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a = make_engine(capsule_dir=a_dir)
    run(a, OBS[:6])
    grasp = a.checkpoint(name="grasp", persist=True)
    b = make_engine(capsule_dir=b_dir)
    run(b, OBS[:2])
    held = b.checkpoint()  # c0001 of B, in B's planner's hands
    mine = b.checkpoint(name="mine", persist=True)
    assert grasp.id == held.id == "c0001"
    del a, b
    (b_dir / "grasp.fcap").write_bytes((a_dir / "grasp.fcap").read_bytes())
    kept = (b_dir / "mine.fcap").read_bytes()
    (b_dir / "mine.fcap").unlink()
    (b_dir / "mine.fcap").write_bytes(kept)
    again = make_engine(capsule_dir=b_dir)
    by_name = {c.name: c for c in again.capsules()}
    assert by_name["grasp"].checksum == grasp.checksum and by_name["grasp"].id != "c0001"
    assert by_name["mine"].id == mine.id  # B's own file keeps the id B's planner kept
    with pytest.raises(UnknownReference):
        again.restore("c0001")


def test_a_recorded_step_cannot_take_a_name_a_file_holds(tmp_path):
    """checkpoint_at (a recorded step into the pool) skipped the held-name check the plain
    checkpoint makes: 'grasp' of an evicted persisted capsule was taken by another state."""
    from test.engine_util import make_engine as engine

    eng = engine(capsule_slots=2, capsule_dir=tmp_path, flight_ticks=8)
    run(eng, OBS[:4])
    eng.checkpoint(name="grasp", persist=True)
    eng.checkpoint()
    eng.checkpoint()  # grasp is evicted; grasp.fcap stays
    with pytest.raises(BadName, match="grasp.fcap exists in capsule_dir"):
        eng.checkpoint_at(2, name="grasp")
    assert eng.checkpoint_at(2, name="other").step == 2
