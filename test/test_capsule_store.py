"""capsule_dir is never lost and never trusted: names, refused calls, restarts, bad folder contents.

Each test is a regression test for one point of the disk-tier review (the number in its name).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from flashrt_ros.capsules import diskfmt
from flashrt_ros.capsules.checksum import device_checksum, to_hex
from flashrt_ros.capsules.id_reserve import FILE as IDS_FILE
from flashrt_ros.capsules.names import check_capsule_name, check_session_name
from flashrt_ros.errors import (
    BadName,
    BadRequest,
    CapacityError,
    CorruptCapsule,
    DiskError,
    FingerprintMismatch,
)
from test.engine_util import immutable, make_engine, observations

OBS = observations(40, seed=5)


def stepped(**kw):
    eng = make_engine(**kw)
    for o in OBS[:3]:
        eng.step(o)
    return eng


def raw_file(header: bytes | dict, payload: bytes, version: int = diskfmt.VERSION) -> bytes:
    """File bytes with a valid digest around any header (forged ones included)."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    head = diskfmt.MAGIC + struct.pack("<II", version, len(hb)) + hb
    return head + payload + hashlib.sha256(head + payload).digest()


@pytest.fixture()
def good(tmp_path):
    """(header, payload) of a valid capsule of the default engine."""
    eng = stepped()
    cap = eng.checkpoint(name="good")
    path = eng.save_capsule(cap.id, tmp_path / "good.fcap")
    header, payload = diskfmt.read_capsule_file(path)
    path.unlink()
    return header, payload


def names_in(d: Path) -> list[str]:
    """The capsule files and others a test put there; not the folder's own .flashrt.* files
    (the ids' reserve, id_reserve.py; its token, store.folder_token)."""
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".flashrt."))


# -- 4: names and ids never collide ----------------------------------------------------------------
def test_4_name_of_the_id_form_is_refused_and_never_overwrites_a_persisted_capsule(tmp_path):
    eng = stepped(capsule_dir=tmp_path)
    first = eng.checkpoint(persist=True)
    assert first.id == "c0001"
    before = (tmp_path / "c0001.fcap").read_bytes()
    eng.step(OBS[5])
    for name in ("c0001", "c0002", "c12345"):
        with pytest.raises(BadName, match="reserved"):
            eng.checkpoint(name=name, persist=True)
        with pytest.raises(BadName, match="reserved"):
            eng.checkpoint(name=name)
    assert (tmp_path / "c0001.fcap").read_bytes() == before
    assert [c.id for c in eng.capsules()] == ["c0001"]
    other = eng.checkpoint(name="other", persist=True)
    eng.drop("c0001")  # the right file goes, and only it
    assert names_in(tmp_path) == ["other.fcap"]
    assert eng.capsule("other").id == other.id


def test_4_a_file_id_never_shadows_a_name(good, tmp_path):
    """A file's id that is no capsule id (a flight-step file's "main-42", a forged "other") is
    replaced by a fresh one, so a lookup by name still finds the named capsule."""
    header, payload = good
    f = tmp_path / "x.fcap"
    f.write_bytes(raw_file(dict(header, id="other", name=""), payload))
    eng = stepped()
    named = eng.checkpoint(name="other")
    loaded = eng.load_capsule(f)
    assert loaded.id not in ("other", named.id) and loaded.id.startswith("c")
    assert eng.capsule("other").id == named.id


# -- 5: a refused call changes nothing, on disk included -------------------------------------------
def test_5_refused_persist_of_an_evicted_name_keeps_its_file(tmp_path):
    eng = stepped(capsule_dir=tmp_path, capsule_slots=2)
    eng.checkpoint(name="foo", persist=True)
    kept = (tmp_path / "foo.fcap").read_bytes()
    eng.step(OBS[6])
    eng.checkpoint(name="a", pin=True)
    eng.checkpoint(name="b", pin=True)  # evicts foo from the pool; its file stays
    assert [c.name for c in eng.capsules()] == ["a", "b"]
    before = eng.capsules()
    with pytest.raises((CapacityError, BadName)):
        eng.checkpoint(name="foo", persist=True)
    assert (tmp_path / "foo.fcap").read_bytes() == kept
    assert names_in(tmp_path) == ["foo.fcap"] and eng.capsules() == before
    eng.drop("b")  # room again: the file still refuses to be overwritten
    with pytest.raises(BadName, match="exists"):
        eng.checkpoint(name="foo", persist=True)
    assert (tmp_path / "foo.fcap").read_bytes() == kept


def test_5_an_evicted_persisted_capsule_is_dropped_by_its_name_file_and_all(tmp_path):
    """A persisted capsule evicted from the pool keeps its file; drop by its name removes that
    file (it was "unknown", so its name stayed taken and files piled up in capsule_dir), and
    the name is free for a new persist. Drop never removes the file of a live capsule, a file
    of another policy, or anything but a capsule file named by a capsule name."""
    eng = stepped(capsule_dir=tmp_path, capsule_slots=2)
    foo = eng.checkpoint(name="foo", persist=True)
    eng.checkpoint(name="a", pin=True)
    eng.checkpoint(name="b", pin=True)  # evicts foo from the pool; its file stays
    assert "foo" not in [c.name for c in eng.capsules()]
    before = eng.capsules()
    gone = eng.drop("foo")
    assert (gone.id, gone.name, gone.tier, gone.checksum) == (foo.id, "foo", "disk", foo.checksum)
    assert names_in(tmp_path) == [] and eng.capsules() == before
    with pytest.raises(ValueError, match="unknown capsule"):
        eng.drop("foo")  # once only
    eng.drop("b")
    assert eng.checkpoint(name="foo", persist=True).name == "foo"  # the name is free again
    # the file a live capsule was loaded from (renamed on disk) is that capsule's to drop
    os.rename(tmp_path / "foo.fcap", tmp_path / "renamed.fcap")
    again = make_engine(capsule_dir=tmp_path)
    with pytest.raises(ValueError, match="is the file of capsule .*'foo'"):
        again.drop("renamed")
    assert names_in(tmp_path) == ["renamed.fcap"]
    # another policy's file is refused and left in place; a path is never a reference
    other = make_engine(capsule_dir=tmp_path / "other", policy="builtin:act")
    other.checkpoint(name="theirs", persist=True)
    os.rename(tmp_path / "other" / "theirs.fcap", tmp_path / "theirs.fcap")
    with pytest.raises(ValueError):
        again.drop("theirs")
    with pytest.raises(ValueError):
        again.drop("../renamed")
    assert names_in(tmp_path) == ["other", "renamed.fcap", "theirs.fcap"]


def test_5_full_pool_refuses_persist_before_writing(tmp_path):
    eng = stepped(capsule_dir=tmp_path, capsule_slots=1)
    eng.checkpoint(name="a", pin=True)
    with pytest.raises(CapacityError):
        eng.checkpoint(name="new", persist=True)
    with pytest.raises(CapacityError):
        eng.checkpoint(persist=True)
    assert names_in(tmp_path) == []


def test_5_persist_never_overwrites_a_foreign_file_or_follows_a_link(tmp_path):
    d, outside = tmp_path / "caps", tmp_path / "outside"
    d.mkdir()
    outside.write_bytes(b"precious")
    (d / "taken.fcap").write_bytes(b"not a capsule, not ours")
    (d / "link.fcap").symlink_to(outside)
    eng = stepped(capsule_dir=d)
    for name in ("taken", "link"):
        with pytest.raises(BadName, match="exists"):
            eng.checkpoint(name=name, persist=True)
    assert (d / "taken.fcap").read_bytes() == b"not a capsule, not ours"
    assert outside.read_bytes() == b"precious" and eng.capsules() == []


# -- 6: pins survive a restart; a reload never evicts ----------------------------------------------
def test_6_pins_are_persisted_and_reload_never_evicts(tmp_path):
    eng = stepped(capsule_dir=tmp_path, capsule_slots=4)
    eng.checkpoint(name="old_pinned", pin=True, persist=True)
    for i, o in enumerate(OBS[10:13]):
        eng.step(o)
        eng.checkpoint(name=f"n{i}", persist=True)
    again = make_engine(capsule_dir=tmp_path, capsule_slots=2)
    assert {c.name: c.pinned for c in again.capsules()} == {"old_pinned": True, "n2": False}
    missing = {Path(p).name: why for p, why in again.store.not_loaded}
    assert set(missing) == {"n0.fcap", "n1.fcap"}
    assert all("full" in why for why in missing.values())
    assert len(names_in(tmp_path)) == 4  # nothing deleted


def test_6_more_pinned_files_than_slots_loads_the_newest_and_reports_the_rest(tmp_path):
    eng = stepped(capsule_dir=tmp_path, capsule_slots=3)
    for i, o in enumerate(OBS[10:13]):
        eng.step(o)
        eng.checkpoint(name=f"p{i}", pin=True, persist=True)
    again = make_engine(capsule_dir=tmp_path, capsule_slots=2)
    assert [(c.name, c.pinned) for c in again.capsules()] == [("p1", True), ("p2", True)]
    (skipped,) = again.store.not_loaded
    assert skipped.path == tmp_path / "p0.fcap" and "capsule_slots" in skipped.reason
    assert len(names_in(tmp_path)) == 3


def test_6_pin_rewrites_the_file_atomically(tmp_path):
    eng = stepped(capsule_dir=tmp_path)
    eng.checkpoint(name="p", persist=True)
    assert eng.pin("p").pinned
    assert make_engine(capsule_dir=tmp_path).capsule("p").pinned
    eng.pin("p", False)
    assert not make_engine(capsule_dir=tmp_path).capsule("p").pinned
    assert names_in(tmp_path) == ["p.fcap"]  # no temp file left


def test_6_version_1_files_are_read_as_unpinned(good, tmp_path):
    header, payload = good
    v1 = {k: v for k, v in header.items() if k != "pinned"}
    (tmp_path / "old.fcap").write_bytes(raw_file(v1, payload, version=1))
    eng = make_engine(capsule_dir=tmp_path)
    assert [(c.name, c.pinned) for c in eng.capsules()] == [("good", False)]
    v2 = {k: v for k, v in header.items() if k != "pinned"}  # version 2 needs the field
    (tmp_path / "new.fcap").write_bytes(raw_file(v2, payload, version=2))
    with pytest.raises(CorruptCapsule, match="pinned"):
        eng.load_capsule(tmp_path / "new.fcap", name="renamed")


# -- 7: temp files, ids and renamed files ----------------------------------------------------------
def test_7_stale_temp_files_are_cleaned_at_start_without_following_links(tmp_path):
    d, outside = tmp_path / "caps", tmp_path / "outside.fcap.tmp1"
    d.mkdir()
    outside.write_bytes(b"keep")
    stale = [".x.fcap.tmp4242", ".y.fcap.a1b2_c3.tmp"]
    for n in stale:
        (d / n).write_bytes(b"half a capsule")
    (d / ".z.fcap.tmp7").symlink_to(outside)
    (d / ".w.fcap.tmp8").mkdir()
    (d / "notes.tmp").write_bytes(b"not ours")
    make_engine(capsule_dir=d)
    assert names_in(d) == [".w.fcap.tmp8", ".z.fcap.tmp7", "notes.tmp"]
    assert outside.read_bytes() == b"keep"


def test_7_a_failed_persist_does_not_consume_an_id(tmp_path):
    d = tmp_path / "caps"
    d.mkdir()
    eng = stepped(capsule_dir=d, capsule_slots=1)
    shutil.rmtree(d)  # the folder goes (it holds the ids' reserve, id_reserve.py)
    with pytest.raises(BadRequest):
        eng.checkpoint(persist=True)
    d.mkdir()
    pinned = eng.checkpoint(persist=True, pin=True)
    assert pinned.id == "c0001"
    with pytest.raises(CapacityError):
        eng.checkpoint(persist=True)
    eng.drop("c0001")
    assert eng.checkpoint(persist=True).id == "c0002"


def test_7_ids_are_not_reissued_after_a_restart_on_the_same_folder(tmp_path):
    """A planner keeps the ids it was given and may outlive the process: a new Engine on the
    same capsule_dir (a restart, a kill -9 included) issues none of the last run's ids, also
    of capsules that were never persisted, so a remembered id cannot restore another state.
    A reserve that cannot be read is ignored: ids then start after the files."""
    first = stepped(capsule_dir=tmp_path)
    kept = [first.checkpoint(persist=True).id] + [first.checkpoint().id for _ in range(3)]
    assert kept == ["c0001", "c0002", "c0003", "c0004"]
    del first  # no clean shutdown: the reserve was written before the first id was issued
    again = stepped(capsule_dir=tmp_path)
    assert [c.id for c in again.capsules()] == ["c0001"]  # the persisted one is back
    new = again.checkpoint().id
    assert new not in kept and int(new[1:]) > 1000, new
    with pytest.raises(ValueError, match="unknown capsule"):
        again.restore("c0002")
    (tmp_path / IDS_FILE).write_text("garbage")
    assert stepped(capsule_dir=tmp_path).checkpoint().id == "c0002"  # after the files only
    # a file loaded later whose header id this engine issued and dropped gets a fresh id
    eng = stepped(capsule_dir=tmp_path / "solo")
    first = eng.checkpoint()
    saved = eng.save_capsule(first.id, tmp_path / "copy.fcap")
    eng.drop(first.id)
    assert eng.load_capsule(saved).id != first.id
    # many ids: the reserve grows block by block, so a restart stays clear of all of them
    many = stepped(capsule_dir=tmp_path, capsule_slots=1)
    last = [many.checkpoint().id for _ in range(1500)][-1]
    assert int(stepped(capsule_dir=tmp_path).checkpoint().id[1:]) > int(last[1:])


def test_7_drop_removes_a_renamed_file(tmp_path):
    eng = stepped(capsule_dir=tmp_path)
    eng.checkpoint(name="foo", persist=True)
    eng.checkpoint(persist=True)
    os.rename(tmp_path / "foo.fcap", tmp_path / "renamed.fcap")
    os.rename(tmp_path / "c0002.fcap", tmp_path / "renamed2.fcap")
    again = make_engine(capsule_dir=tmp_path)
    again.drop("foo")
    # renamed by hand, it comes back under a fresh id (test_capsule_files.py says why)
    [moved] = [c for c in again.capsules() if c.name == ""]
    assert moved.id not in ("c0001", "c0002")
    again.drop(moved.id)
    assert names_in(tmp_path) == []
    assert make_engine(capsule_dir=tmp_path).capsules() == []


def test_7_drop_of_an_evicted_id_reused_by_a_load_keeps_the_other_file(tmp_path):
    """An id freed by eviction whose file stays in capsule_dir is not given to a loaded
    capsule (its header says c0001 too): dropping that capsule keeps the evicted one's file."""
    d = tmp_path / "caps"
    d.mkdir()
    eng = stepped(capsule_dir=d, capsule_slots=1)
    first = eng.checkpoint(persist=True)  # c0001.fcap
    export = eng.save_capsule(first.id, tmp_path / "export.fcap")
    eng.step(OBS[7])
    eng.checkpoint()  # evicts c0001 (file stays)
    other = make_engine(capsule_slots=1)
    for o in OBS[:9]:
        other.step(o)
    foreign = other.save_capsule(other.checkpoint().id, tmp_path / "foreign.fcap")  # id c0001
    loaded = eng.load_capsule(foreign)
    assert loaded.id != "c0001"
    eng.drop(loaded.id)
    assert (d / "c0001.fcap").exists()
    assert diskfmt.read_capsule_file(d / "c0001.fcap")[1] == diskfmt.read_capsule_file(export)[1]


def test_7_a_copy_of_a_capsule_file_never_takes_the_id_of_another_file(tmp_path):
    """A copy of c0001.fcap in capsule_dir (a backup, named anything) carries id c0001 in its
    header. At a restart each file must come back under its own file's id and the copy under a
    fresh one, so a drop removes the dropped capsule's file and no other."""
    d = tmp_path / "caps"
    d.mkdir()
    eng = stepped(capsule_dir=d)
    a = eng.checkpoint(persist=True)  # c0001.fcap
    eng.step(OBS[5])
    b = eng.checkpoint(persist=True)  # c0002.fcap
    (d / "backup.fcap").write_bytes((d / f"{a.id}.fcap").read_bytes())  # loaded first (sorted)
    again = make_engine(capsule_dir=d)
    by_id = {i.id: i.checksum for i in again.capsules()}
    assert by_id[a.id] == a.checksum and by_id[b.id] == b.checksum and len(by_id) == 3
    copy_id = next(i for i in by_id if i not in (a.id, b.id))
    new = again.checkpoint()  # a fresh id, not one of a file
    assert new.id not in (a.id, b.id, copy_id)
    again.drop(b.id)
    assert names_in(d) == ["backup.fcap", f"{a.id}.fcap"]
    again.drop(copy_id)
    assert names_in(d) == [f"{a.id}.fcap"]


def test_7_a_header_step_that_is_not_the_states_counter_is_refused(good, tmp_path):
    """The flight ring and a chunked policy's tick kinds follow the state's own step counter:
    a file whose header names another step is refused on load, and nothing changes."""
    header, payload = good
    f = diskfmt.write_capsule_file(tmp_path / "lie.fcap", dict(header, step=1000), payload)
    eng = stepped()
    before = (eng.state_bytes(), eng.session_step(), eng.capsules())
    with pytest.raises(CorruptCapsule, match="step 1000.*counter 3"):
        eng.load_capsule(f)
    assert before == (eng.state_bytes(), eng.session_step(), eng.capsules())


# -- 8: never hang or exhaust memory on capsule_dir contents ---------------------------------------
@pytest.mark.timeout(30)
def test_8_fifo_and_device_links_neither_block_nor_exhaust(tmp_path):
    os.mkfifo(tmp_path / "fifo.fcap")
    (tmp_path / "zero.fcap").symlink_to("/dev/zero")
    (tmp_path / "dir.fcap").mkdir()
    eng = make_engine(capsule_dir=tmp_path)
    reasons = {Path(p).name: why for p, why in eng.store.not_loaded}
    assert "regular" in reasons["fifo.fcap"] and "symlink" in reasons["zero.fcap"]
    assert "regular" in reasons["dir.fcap"]
    for n in ("fifo.fcap", "zero.fcap", "dir.fcap"):
        with pytest.raises(CorruptCapsule, match=n):
            eng.load_capsule(tmp_path / n)
    assert eng.capsules() == []


def test_8_sizes_are_checked_before_the_payload_is_read(good, tmp_path):
    header, _ = good
    big = 1 << 29  # a sparse file: 512 MiB that takes no disk
    hb = json.dumps(dict(header, nbytes=big)).encode()
    f = tmp_path / "sparse.fcap"
    with open(f, "wb") as fh:
        fh.write(diskfmt.MAGIC + struct.pack("<II", diskfmt.VERSION, len(hb)) + hb)
        fh.truncate(16 + len(hb) + big + 32)
    eng = make_engine()
    tracemalloc.start()
    try:
        with pytest.raises(FingerprintMismatch, match="layout"):
            eng.load_capsule(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def _forged(header: dict, payload: bytes) -> dict[str, bytes]:
    hjson = json.dumps(header)
    deep = hjson[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    return {
        "huge_stamp": raw_file(dict(header, stamp=10**400), payload),
        "huge_step": raw_file(dict(header, step=10**400), payload),
        "deep": raw_file(deep.encode(), payload),
        "nan_const": raw_file(hjson.replace('"stamp": ', '"stamp": NaN, "x": ').encode(), payload),
        "bad_utf8": raw_file(b'{"a": "\xff"}', payload),
        "list": raw_file(b"[1, 2]", payload),
        "layout_junk": raw_file(dict(header, layout=[{"dtype": "float32"}]), payload),
    }


@pytest.mark.parametrize("kind", list(_forged({}, b"")))
def test_8_every_malformed_header_is_a_corrupt_capsule_naming_the_file(good, tmp_path, kind):
    header, payload = good
    f = tmp_path / f"{kind}.fcap"
    f.write_bytes(_forged(header, payload)[kind])
    with pytest.raises(CorruptCapsule, match=f"{kind}.fcap"):
        diskfmt.read_capsule_file(f)
    eng = make_engine(capsule_dir=tmp_path)  # skipped and reported at start, never fatal
    assert eng.capsules() == [] and [Path(p).name for p, _ in eng.store.not_loaded] == [f.name]


def _nonfinite(header: dict, payload: bytes, value: float) -> tuple[dict, bytes]:
    row = next(r for r in header["layout"] if r["name"] == "h")
    state = bytearray(payload)
    state[row["offset"] + 4 : row["offset"] + 8] = np.float32(value).tobytes()
    checksum = to_hex(device_checksum(torch.frombuffer(bytearray(state), dtype=torch.uint8)))
    return dict(header, checksum=checksum), bytes(state)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_8_non_finite_state_is_refused(good, tmp_path, value):
    header, payload = _nonfinite(*good, value)
    f = diskfmt.write_capsule_file(tmp_path / "bad.fcap", header, payload)
    eng = make_engine()
    with pytest.raises(CorruptCapsule, match="'h'.*(NaN|Inf)"):
        eng.load_capsule(f)
    assert eng.capsules() == []
    reloaded = make_engine(capsule_dir=tmp_path)
    assert reloaded.capsules() == [] and len(reloaded.store.not_loaded) == 1


# -- 9: temp files are exclusive and never follow a planted link -----------------------------------
def test_9_planted_temp_links_never_redirect_a_persist(tmp_path):
    d, outside = tmp_path / "caps", tmp_path / "outside"
    d.mkdir()
    outside.write_bytes(b"precious")
    eng = stepped(capsule_dir=d)
    for name in ("x", "c0002"):  # the old predictable temp names, for a name and for an id
        (d / f".{name}.fcap.tmp{os.getpid()}").symlink_to(outside)
    eng.checkpoint(name="x", persist=True)
    assert eng.checkpoint(persist=True).id == "c0002"
    assert outside.read_bytes() == b"precious"
    for name in ("x.fcap", "c0002.fcap"):
        assert (d / name).is_file() and not (d / name).is_symlink()
        diskfmt.read_capsule_file(d / name)


def test_9_save_capsule_never_overwrites(tmp_path):
    eng = stepped()
    cap = eng.checkpoint()
    (tmp_path / "there.fcap").write_bytes(b"mine")
    with pytest.raises(BadRequest, match="exists"):
        eng.save_capsule(cap.id, tmp_path / "there.fcap")
    assert (tmp_path / "there.fcap").read_bytes() == b"mine"
    assert names_in(tmp_path) == ["there.fcap"]


# -- 10: symlinks in capsule_dir are refused -------------------------------------------------------
def test_10_symlinked_capsules_are_not_loaded(tmp_path):
    d, outside = tmp_path / "caps", tmp_path / "elsewhere"
    d.mkdir()
    outside.mkdir()
    eng = stepped(capsule_dir=outside)
    eng.checkpoint(name="far", persist=True)
    (d / "far.fcap").symlink_to(outside / "far.fcap")
    again = make_engine(capsule_dir=d)
    assert again.capsules() == []
    assert [(Path(p).name, "symlink" in why) for p, why in again.store.not_loaded] == [
        ("far.fcap", True)
    ]
    with pytest.raises(CorruptCapsule, match="symlink"):
        again.load_capsule(d / "far.fcap")


# -- errors a caller can act on --------------------------------------------------------------------
def test_errors_name_the_problem(tmp_path):
    eng = stepped(capsule_dir=tmp_path)
    cap = eng.checkpoint(name="e")
    with pytest.raises(BadRequest, match="path"):
        eng.save_capsule(cap.id)
    for bad in (None, 3, b"x.fcap"):
        with pytest.raises(BadRequest):
            eng.save_capsule(cap.id, bad)
        with pytest.raises(BadRequest):
            eng.load_capsule(bad)
    with pytest.raises(BadRequest):
        eng.save_capsule(7, tmp_path / "seven.fcap")
    with pytest.raises(BadName):
        eng.load_capsule(tmp_path / "x.fcap", name=5)
    with pytest.raises(BadName):
        check_capsule_name("../x")
    with pytest.raises(BadName):
        check_session_name("a b")
    path = eng.save_capsule("e", tmp_path / "e.export")
    other = make_engine(policy="test.engine_util:tiny_policy")
    with pytest.raises(FingerprintMismatch, match="fingerprint") as refused:
        other.load_capsule(path)
    # which policy wrote it, and which this engine runs
    said = f"written by {eng.policy.policy_id}, this engine runs {other.policy.policy_id}"
    assert said in str(refused.value)
    assert names_in(tmp_path) == ["e.export"]


def test_a_capsule_dir_or_weights_path_under_a_tilde_is_in_the_home_folder(tmp_path, monkeypatch):
    """A params file does not expand "~" (compile_cache_dir's default uses it, and is
    expanded): capsule_dir "~/capsules" and weights "~/w.pt" were refused as missing."""
    import shutil

    from flashrt_ros import load_policy
    from flashrt_ros.policies.loader import BUILTIN_WEIGHTS

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "caps").mkdir()
    shutil.copy(BUILTIN_WEIGHTS, tmp_path / "w.pt")
    eng = make_engine(policy="builtin:hybrid", capsule_dir="~/caps")
    eng.checkpoint(name="kept", persist=True)
    assert (tmp_path / "caps" / "kept.fcap").is_file()
    shipped = load_policy("builtin:hybrid")
    mine = load_policy("builtin:hybrid", weights="~/w.pt")
    pairs = zip(shipped.parameters(), mine.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_capsule_still_being_written_is_named_so_not_unknown(tmp_path):
    """A persisted checkpoint's file is written without the engine lock: a drop or restore of
    its name meanwhile is told it is being written, not that it is unknown."""
    eng = make_engine(policy="builtin:hybrid", capsule_dir=tmp_path)
    pending = eng.begin_persist("main", "dup")
    for ref in ("dup", pending.info.id):
        with pytest.raises(BadRequest, match="still being written"):
            eng.drop(ref)
        with pytest.raises(BadRequest, match="still being written"):
            eng.restore(ref)
    eng.write_persist(pending)
    info = eng.end_persist(pending)
    assert eng.drop("dup").id == info.id and not (tmp_path / "dup.fcap").exists()


def test_a_file_name_near_the_limit_is_written_and_its_temp_is_still_known(tmp_path):
    """A 250-character file name (under Linux's 255) failed: the write's temp name
    `.<name>.<8 random>.tmp` did not fit. Long names get a shorter temp name that keeps the
    `.fcap.` the start's cleanup looks for."""
    from flashrt_ros.capsules.diskfmt import TEMP, _temp_prefix

    eng = stepped()
    info = eng.checkpoint()
    long = tmp_path / ("b" * 245 + ".fcap")
    assert eng.save_capsule(info.id, long) == long and long.exists()
    assert eng.load_capsule(long, name="back").checksum == info.checksum
    prefix = _temp_prefix(long.name)
    assert len(prefix) + 12 <= 255 and TEMP.fullmatch(prefix + "abcd1234.tmp")
    assert _temp_prefix("x.fcap") == ".x.fcap."  # short names as before


def test_a_capsule_of_another_noise_or_ensemble_setting_is_refused(tmp_path):
    """builtin:hybrid's noise_std and ensemble_decay change every action but were not in its
    policy id, so the fingerprints matched: a capsule saved with noise_std=0.5 loaded into the
    default engine and continued differently with no error. The default keeps its id."""
    from flashrt_ros import Engine, load_policy

    default = Engine(load_policy("builtin:hybrid"), device="cpu")
    assert default.policy.policy_id == "builtin:hybrid/d64-l2-h4-kv64-k4-c8"
    path = default.save_capsule(default.checkpoint().id, tmp_path / "default.fcap")
    for kw in ({"noise_std": 0.5}, {"ensemble_decay": 0.9}):
        other = Engine(load_policy("builtin:hybrid", **kw), device="cpu")
        assert other.fingerprint != default.fingerprint, kw
        with pytest.raises(FingerprintMismatch, match="written by builtin:hybrid/d64"):
            other.load_capsule(path)


def test_the_same_setting_written_two_ways_is_one_policy():
    """noise_std=0 and noise_std=0.0 are one configuration: one policy id, one fingerprint."""
    from flashrt_ros import load_policy

    a, b = load_policy("builtin:hybrid", noise_std=0), load_policy("builtin:hybrid", noise_std=0.0)
    assert a.policy_id == b.policy_id and a.policy_id.endswith("-n0.0")
    assert a.weights_digest() == b.weights_digest()


def test_derived_tensors_are_in_the_fingerprint():
    """A diffusion policy's denoising steps change its schedule (derived_buffers, outside the
    state dict) but not its policy id: an engine of 5 steps took a capsule of 10 without a word."""
    from flashrt_ros import load_policy

    ten = load_policy("builtin:diffusion")
    five = load_policy("builtin:diffusion", num_inference_steps=5)
    assert ten.policy_id == five.policy_id  # the id does not say it...
    assert ten.weights_digest() != five.weights_digest()  # ...the fingerprint does


def test_files_of_the_version_before_derived_digests_still_load(tmp_path):
    """Reading derived_buffers into the fingerprint changed every built-in's fingerprint: after
    an upgrade, a robot's start skipped each persisted capsule as foreign and its name stayed
    held. A file as those versions wrote it (their fingerprint: the state dict alone, and no
    folder token) is this engine's still; the same fingerprint in a file with a token is not
    (only versions with the new fingerprint write tokens)."""
    from flashrt_ros import Engine, load_policy

    folder = tmp_path / "caps"
    folder.mkdir()
    eng = Engine(load_policy("builtin:hybrid"), device="cpu", capsule_dir=folder)
    for o in OBS[:3]:
        eng.step(o)
    assert eng.fingerprint_v1 not in (None, eng.fingerprint)
    path = eng.save_capsule(eng.checkpoint().id, tmp_path / "now.fcap")
    header, payload = diskfmt.read_capsule_file(path)
    old = {k: v for k, v in header.items() if k != "folder"}
    old.update(fingerprint=eng.fingerprint_v1, id="c0042", name="grasp")
    (folder / "grasp.fcap").write_bytes(raw_file(old, payload))
    tokened = dict(old, folder="0123abcd", name="")
    (tmp_path / "tokened.fcap").write_bytes(raw_file(tokened, payload))

    again = Engine(load_policy("builtin:hybrid"), device="cpu", capsule_dir=folder)
    assert again.store.not_loaded == []
    kept = {c.name: c for c in again.capsules()}["grasp"]
    assert kept.checksum == header["checksum"]
    again.restore("grasp")
    with pytest.raises(FingerprintMismatch):
        again.load_capsule(tmp_path / "tokened.fcap")


@pytest.mark.parametrize("content", [b"", b"ab-cd\n", b"\xff\xfe\x00"])
def test_a_token_file_that_holds_no_token_is_replaced_and_the_start_goes_on(tmp_path, content):
    """An empty .flashrt.folder (a power cut after it was made) or one of other bytes sent the
    token's reader into endless recursion: every start of the engine failed until someone
    deleted the file. It is replaced by a new token, and capsules persist and reload."""
    from flashrt_ros.capsules.store import TOKEN_FILE

    (tmp_path / TOKEN_FILE).write_bytes(content)
    eng = stepped(capsule_dir=tmp_path)
    token = (tmp_path / TOKEN_FILE).read_text().strip()
    assert token.isalnum() and len(token) == 16
    eng.checkpoint(name="kept", persist=True)
    assert diskfmt.read_capsule_header(tmp_path / "kept.fcap")["folder"] == token
    again = make_engine(capsule_dir=tmp_path)
    assert [c.name for c in again.capsules()] == ["kept"]
    assert again.store.token == token


def test_only_a_refusing_disk_is_a_disk_error(tmp_path):
    """/diagnostics counts failed writes to capsule_dir (disk_write_failures) and WARNs until one
    succeeds: a file that exists (a name taken meanwhile) is a refused request, not the disk's
    trouble, and must not raise that WARN; a folder the disk refuses is."""
    from flashrt_ros.errors import DiskError

    eng = stepped()
    info = eng.checkpoint()
    (tmp_path / "taken.fcap").write_bytes(b"x")
    with pytest.raises(BadRequest, match="exists") as taken:
        eng.store.write(tmp_path / "taken.fcap", info, eng.pool.slab[0])
    assert not isinstance(taken.value, DiskError)
    # a folder nobody may create files in, root included (tests run as root in CI)
    with pytest.raises(DiskError, match="cannot write"):
        eng.store.write(Path("/proc/self/x.fcap"), info, eng.pool.slab[0])


def test_a_file_the_disk_will_not_remove_or_replace_refuses_drop_and_pin_changing_nothing(
    tmp_path,
):
    """A capsule file capsule_dir refuses to remove or replace (immutable, a read-only mount):
    drop and pin are DiskErrors (the node's /diagnostics counts them as the disk's trouble, not
    the caller's), and the capsule, its pin and its file stay as they were; once the disk lets
    go, the same calls work."""
    eng = stepped(capsule_dir=tmp_path, capsule_slots=2)
    eng.checkpoint(name="kept", persist=True)
    gone = eng.checkpoint(name="gone", persist=True)
    eng.checkpoint(name="a", pin=True)
    eng.checkpoint(name="b", pin=True)  # evicts both persisted capsules: their files stay
    eng.drop("b")
    eng.load_capsule(tmp_path / "kept.fcap")  # back into the pool, from its file
    before = [(c.id, c.name, c.pinned) for c in eng.capsules()]
    files = (tmp_path / "kept.fcap", tmp_path / "gone.fcap")
    with immutable(*files):
        with pytest.raises(DiskError, match=r"cannot remove .*kept\.fcap: Operation not perm"):
            eng.drop("kept")  # in the pool, with its file
        with pytest.raises(DiskError, match=r"cannot rewrite .*kept\.fcap: Operation not perm"):
            eng.pin("kept")
        with pytest.raises(DiskError, match=r"cannot remove .*gone\.fcap"):
            eng.drop("gone")  # only its file
        assert [(c.id, c.name, c.pinned) for c in eng.capsules()] == before
        assert names_in(tmp_path) == ["gone.fcap", "kept.fcap"]
    assert eng.pin("kept").pinned and make_engine(capsule_dir=tmp_path).capsule("kept").pinned
    assert eng.drop("kept").name == "kept" and eng.drop("gone").id == gone.id
    assert names_in(tmp_path) == []


def test_a_file_not_loaded_at_start_leaves_the_list_once_loaded_or_moved_out(tmp_path):
    """/diagnostics names the files the start did not load (capsule_files_not_loaded,
    last_not_loaded); it went on naming one after the operator loaded it or moved it away."""
    eng = stepped(capsule_dir=tmp_path, capsule_slots=4)
    for name in ("a", "b", "c"):
        eng.checkpoint(name=name, persist=True)
    small = make_engine(capsule_dir=tmp_path, capsule_slots=2)
    (skipped,) = small.store.still_not_loaded()
    assert "slot" in skipped.reason, skipped
    kept = [c.name for c in small.capsules()]
    small.drop(kept[0])  # room, and its file goes with it
    small.load_capsule(skipped.path)
    assert small.store.still_not_loaded() == []
    (tmp_path / "junk.fcap").write_bytes(b"not a capsule")
    again = make_engine(capsule_dir=tmp_path, capsule_slots=2)
    (junk,) = again.store.still_not_loaded()
    assert junk.path.name == "junk.fcap"
    junk.path.rename(tmp_path.parent / "junk.fcap")  # the operator moves it out
    assert again.store.still_not_loaded() == []
