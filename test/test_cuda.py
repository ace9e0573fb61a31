"""The CUDA-path checks as assertions, on the GPU machine (no ROS needed):

    FLASHRT_REQUIRE_CUDA=1 python3 -m pytest -q -m cuda test/test_cuda.py

The checks are written once, in bench/checks.py (bench/run_all.py and bench/cuda_check.py record
the same ones in their JSON and fail on them). Each test runs one group and fails naming every
failed check with what it measured. Where torch sees no CUDA device these tests are skipped
(conftest.py); bench.checks is imported only by a test that runs.
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def ck():
    from bench import checks

    return checks


def assert_checks(results) -> None:
    assert results, "the group returned no checks"
    bad = [c for c in results if not c.ok]
    assert not bad, "failed checks: " + "; ".join(f"{c.name} {c.detail}" for c in bad)


def test_copies_and_checksums_take_the_driver_paths(ck):
    """cuda-python copies, one-node graphs and the NVRTC checksum kernel are in use (else the
    tests below would only exercise the torch fallbacks)."""
    assert_checks(ck.driver_paths())


def test_restore_and_branch_continue_bitwise_kv_only_diverges(ck):
    """Restore (also from another thread) and branch continue bit for bit with equal
    checksums; recipes.restore_regions(..., ("kv",)) does not."""
    assert_checks(ck.capsules_continue())


def test_fused_graph_matches_eager(ck):
    """Fused captured step within ACTION_TOL of eager CUDA and of the CPU over 500 steps; the
    unfused graph equals eager bit for bit."""
    assert_checks(ck.graph_vs_eager())


def test_10k_replays_allocate_nothing_and_stay_finite(ck):
    assert_checks(ck.replay_stable(10_000))


def test_checksum_kernel_equals_reference_and_sees_a_flipped_bit(ck):
    assert_checks(ck.checksum_kernel())


def test_flight_ring_kernel_records_inside_the_graph(ck):
    """cuda/ring.py's kernel writes the ring inside the captured step (fused and unfused):
    slots hold their steps after a wrap, and a rewind replays bit for bit."""
    assert_checks(ck.flight_ring())


def test_copies_exact_256B_to_64MB_and_cache_eviction(ck):
    assert_checks(ck.copies_exact())


def test_exported_policy_captured_matches_module(ck):
    assert_checks(ck.exported_policy())


# -- Engine.checkpoint: one device pass, one host wait ------------------------------------------
# These build an Engine themselves (unfused, so no inductor compile) instead of a bench.checks
# group: they patch the engine's wait and torch's sync calls to count host synchronizations.


def _cuda_engine(**kw):
    from test.engine_util import make_engine, observations

    eng = make_engine(device="cuda", fuse=False, **kw)
    for o in observations(20, seed=3):
        eng.step(o)
    return eng


def test_checkpoint_is_one_captured_pass_and_one_host_wait(monkeypatch):
    """Engine.checkpoint on CUDA waits for the device exactly once (Engine._wait, after the
    probe's graph: checksum and finite kernels, the copies into the free slot and its digest
    row, the copy into pinned memory) and syncs nowhere else; the capsule's checksum and the
    slot's digest row are those of the bytes.

    How syncs are counted: torch.cuda.set_sync_debug_mode("error") makes every implicit sync of
    a torch op raise (.cpu()/.tolist()/.item() of a device tensor, torch.equal, a pageable copy:
    what the old path did twice); the explicit waits, which that mode does not see
    (torch.cuda.synchronize, Stream.synchronize, Event.synchronize), are patched to be recorded
    unless they run inside Engine._wait, itself counted. Measured after a warm-up checkpoint into
    the same slot, so first-use work (one-node copy graphs) is not what is counted."""
    import torch

    from flashrt_ros.capsules.checksum import reference_digest, to_hex

    eng = _cuda_engine(capsule_slots=2)
    probe = eng._probes["main"]  # made at start-up
    assert probe.fused, "the pass must be the kernels' driver graph (NVRTC or cuda-python missing?)"
    eng.drop(eng.checkpoint().id)  # warm-up; its slot is the one the next checkpoint takes

    inside = [False]
    waits: list[int] = []
    stray: list[str] = []
    real_wait = eng._wait

    def counted_wait() -> None:
        waits.append(1)
        inside[0] = True
        try:
            real_wait()
        finally:
            inside[0] = False

    def recorded(what: str, fn):
        def call(*a, **k):
            if not inside[0]:
                stray.append(what)
            return fn(*a, **k)

        return call

    monkeypatch.setattr(eng, "_wait", counted_wait)
    monkeypatch.setattr(torch.cuda, "synchronize", recorded("synchronize", torch.cuda.synchronize))
    for cls in (torch.cuda.Stream, torch.cuda.Event):
        monkeypatch.setattr(cls, "synchronize", recorded(cls.__name__, cls.synchronize))
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        info = eng.checkpoint()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    monkeypatch.undo()
    assert waits == [1], f"{len(waits)} waits"
    assert stray == [], f"explicit syncs outside the wait: {stray}"

    state = eng.session("main").arena.buf
    ref = reference_digest(state)
    assert info.checksum == to_hex(ref)
    cap = eng.pool.get(info.id)
    assert torch.equal(cap.digest, ref)
    assert torch.equal(reference_digest(eng.pool.slab[cap.slot]), ref)
    assert eng.restore(info.id, verify=True).checksum == info.checksum


def test_checkpoint_refuses_nan_and_verify_catches_a_flipped_byte_on_cuda(tmp_path):
    """The graph's flags refuse a NaN (nothing taken, no file); a clean checkpoint restores with
    verify; one flipped bit in its slot is caught. Persist writes the probe's checksum."""
    import math

    from flashrt_ros.capsules.checksum import reference_digest, to_hex
    from flashrt_ros.errors import BadRequest, CorruptCapsule
    from test.engine_util import observations

    eng = _cuda_engine(capsule_slots=2, capsule_dir=tmp_path)
    goal = eng.session("main").views["goal"]
    old = goal.clone()
    goal.view(-1)[-1] = math.nan
    free = eng.pool.free_slots()
    for persist in (False, True):
        with pytest.raises(BadRequest, match="NaN or Inf in goal"):
            eng.checkpoint(persist=persist)

    left = [p for p in tmp_path.iterdir() if not p.name.startswith(".flashrt.")]
    assert eng.capsules() == [] and left == []
    assert eng.pool.free_slots() == free  # the slot the pass wrote into stays free
    goal.copy_(old)
    cap = eng.checkpoint(persist=True)
    header, _payload = eng.store.read(tmp_path / f"{cap.id}.fcap")  # checks payload vs checksum
    state = eng.session("main").arena.buf
    assert header["checksum"] == cap.checksum == to_hex(reference_digest(state))
    eng.step(observations(1, seed=9)[0])
    assert eng.restore(cap.id, verify=True).checksum == cap.checksum
    slot = eng.pool.get(cap.id).slot
    eng.pool.slab[slot, 3] ^= 0x10
    before = eng.state_bytes()
    with pytest.raises(CorruptCapsule):
        eng.restore(cap.id, verify=True)
    assert eng.state_bytes() == before


def test_checkpoint_probe_without_the_kernel_digests_after_the_replay(monkeypatch):
    """Where the checksum kernel is missing (as if NVRTC were), the probe's graph holds only the
    flags and torch's digest runs after the replay, so its state-sized temporaries stay out of
    the graph's pool: the checksum is the same, and still read back with the flags."""
    import torch

    from flashrt_ros.capsules import checksum as checksum_mod
    from flashrt_ros.capsules.checksum import reference_digest, to_hex
    from flashrt_ros.runtime import probe as probe_mod

    eng = _cuda_engine()
    for mod in (probe_mod, checksum_mod):
        monkeypatch.setattr(mod, "kernel_ready", lambda buf: False)
    alt = eng.create_session("alt")
    eng.copy_session("main", "alt")
    info = eng.checkpoint("alt")
    assert eng._probes["alt"].plan.graph is not None and not eng._probes["alt"].whole
    ref = reference_digest(alt.arena.buf)
    assert info.checksum == to_hex(ref) == eng.state_checksum("main")
    assert torch.equal(eng.pool.get(info.id).digest, ref)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_finite_kernel_flags_each_region_of_each_float_dtype(dtype):
    """The checkpoint's finite kernel: a flag for exactly the regions holding NaN, +Inf or -Inf
    (at their first, a middle and their last element), none for the largest finite values."""
    import torch

    from flashrt_ros.capsules.checksum import kernel_ready
    from flashrt_ros.cuda import kernels
    from flashrt_ros.cuda.driver import stream

    dt = getattr(torch, dtype)
    buf = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    counts = (7, 100, 1, 33)  # elements per region, each at a 1 KB offset
    regions = [buf[k * 1024 : k * 1024 + n * dt.itemsize].view(dt) for k, n in enumerate(counts)]
    big = torch.finfo(dt).max
    table = torch.tensor(
        [(k * 1024, n, kernels.FINITE_KINDS[dt]) for k, n in enumerate(counts)],
        dtype=torch.int64,
        device="cuda",
    )
    assert kernel_ready(buf) and kernels.finite_ready(0)  # built with the checksum kernel

    def flags() -> list[int]:
        bad = torch.zeros(len(counts), dtype=torch.int64, device="cuda")
        kernels.launch_finite(buf, table, max(counts), bad, stream(0))
        return bad.tolist()

    for r in regions:
        r.fill_(big)
    regions[0][0] = -big
    assert flags() == [0, 0, 0, 0]
    for value, where in ((math.nan, 0), (math.inf, -1), (-math.inf, 50)):
        for k, r in enumerate(regions):
            old = r.clone()
            r[min(where, r.numel() - 1) if where >= 0 else where] = value
            assert flags() == [int(i == k) for i in range(len(counts))], (value, k)
            r.copy_(old)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_one_kernel_pass_digests_flags_and_fills_the_slot(dtype):
    """The checkpoint's pass as one kernel (frt_probe), launched again and again on one
    accumulator it leaves zeroed: each launch gives the reference digest of the bytes in both
    the device result and the mapped pinned readback, a flag for exactly the region holding a
    NaN or Inf, and, given a slot and a digest row, a byte-exact copy and the digest there;
    without them it writes nothing but its results."""
    import torch

    from flashrt_ros.capsules.checksum import _LANES, reference_digest
    from flashrt_ros.cuda import kernels
    from flashrt_ros.cuda.driver import stream

    dt = getattr(torch, dtype)
    buf = torch.zeros(8192, dtype=torch.uint8, device="cuda")
    buf.view(torch.int32).copy_(torch.randint(-(2**31), 2**31 - 1, (2048,), dtype=torch.int32))
    counts = (7, 100, 1, 33)
    regions = [buf[k * 1024 : k * 1024 + n * dt.itemsize].view(dt) for k, n in enumerate(counts)]
    for r in regions:
        r.fill_(1.5)
    table = torch.tensor(
        [(k * 1024, n, kernels.FINITE_KINDS[dt]) for k, n in enumerate(counts)],
        dtype=torch.int64,
        device="cuda",
    )
    kernels.function(0, _LANES)
    assert kernels.probe_ready(0)
    n = 2 + len(counts)
    acc = torch.zeros(n + 1, dtype=torch.int64, device="cuda")
    out = torch.zeros(n, dtype=torch.int64, device="cuda")
    host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
    host_ptr = kernels.host_device_pointer(host)
    assert host_ptr is not None, "pinned memory is not mapped for the device"
    slab = torch.zeros((2, buf.numel()), dtype=torch.uint8, device="cuda")
    rows = torch.zeros((2, 2), dtype=torch.int64, device="cuda")

    def run(slot: int | None) -> list[int]:
        host.zero_()
        s, r = (None, None) if slot is None else (slab[slot], rows[slot].view(torch.uint8))
        kernels.launch_probe(buf, table, max(counts), acc, out, host_ptr, s, r, stream(0))
        torch.cuda.synchronize()
        assert acc.tolist() == [0] * (n + 1), "the accumulator is left zeroed"
        assert host.tolist() == out.tolist()
        return host.tolist()

    for k in (None, 0, 1, None):
        got = run(k)
        assert got[:2] == reference_digest(buf).tolist() and got[2:] == [0, 0, 0, 0]
    assert torch.equal(slab[0], buf) and torch.equal(slab[1], buf)
    assert rows.tolist() == [reference_digest(buf).tolist()] * 2
    slab.zero_()
    for value, where in ((math.nan, 0), (math.inf, -1), (-math.inf, 50)):
        for k, r in enumerate(regions):
            old = r.clone()
            r[min(where, r.numel() - 1) if where >= 0 else where] = value
            got = run(None)
            assert got[2:] == [int(i == k) for i in range(len(counts))], (value, k)
            assert got[:2] == reference_digest(buf).tolist()
            r.copy_(old)
    assert int(slab.count_nonzero()) == 0, "no slot given: none written"


def test_checkpoint_pass_is_one_kernel_and_matches_the_six_node_graph(monkeypatch):
    """An Engine's checkpoint probe on the H200 is the one kernel, and the older graph of six
    nodes (its fallback) gives the same checksum, slot bytes and digest row for the same state."""
    import torch

    from flashrt_ros.runtime import probe as probe_mod

    eng = _cuda_engine(capsule_slots=4)
    assert eng._probes["main"]._one is not None
    one = eng.checkpoint()
    monkeypatch.setattr(probe_mod, "ONE_KERNEL", False)
    eng.create_session("alt")
    eng.copy_session("main", "alt")
    six = eng.checkpoint("alt")
    assert eng._probes["alt"]._one is None and eng._probes["alt"].fused
    assert one.checksum == six.checksum
    a, b = eng.pool.get(one.id), eng.pool.get(six.id)
    assert torch.equal(eng.pool.slab[a.slot], eng.pool.slab[b.slot])
    assert torch.equal(a.digest, b.digest)
    for cid in (one.id, six.id):
        assert eng.restore(cid, "alt", verify=True).checksum == one.checksum


def test_one_kernel_pass_fills_slots_and_refuses_nan_without_using_an_id():
    """The one kernel's checkpoints into two slots (and again into the first, its graph
    reused) hold the state's bytes and digest; a NaN is refused with the slot left free and no
    id used up, though the id was picked while the pass ran (the next capsule takes the id the
    refused one would have). (A direct launch with its arguments packed once was tried on an
    H100 on 2026-12-06: pinned to one CPU, it took 10.8-12.2 us p50 against the graph's
    7.3-10.4; it went.)"""
    import math

    import torch

    from flashrt_ros.capsules.checksum import reference_digest, to_hex
    from flashrt_ros.errors import BadRequest

    eng = _cuda_engine(capsule_slots=3)
    state = eng.session("main").arena.buf
    ref = to_hex(reference_digest(state))
    a, b = eng.checkpoint(), eng.checkpoint()
    eng.drop(a.id)
    c = eng.checkpoint()  # a's slot again: its graph is reused
    assert len(eng._probes["main"]._graphs) == 2
    for info in (b, c):
        cap = eng.pool.get(info.id)
        assert info.checksum == ref and to_hex(cap.digest) == ref
        assert torch.equal(eng.pool.slab[cap.slot], state)
    goal = eng.session("main").views["goal"]
    old = goal.clone()
    goal.view(-1)[0] = math.nan
    free, next_id = eng.pool.free_slots(), eng.pool.next_number()
    with pytest.raises(BadRequest, match="NaN or Inf in goal"):
        eng.checkpoint()
    assert eng.pool.free_slots() == free and eng.pool.next_number() == next_id
    assert [i.id for i in eng.capsules()] == [b.id, c.id]
    goal.copy_(old)
    d = eng.checkpoint()
    assert d.id == f"c{next_id:04d}" and d.checksum == ref
    assert eng.restore(d.id, verify=True).checksum == ref


def test_checkpoint_with_a_full_pool_evicts_and_restores_on_cuda():
    """No free slot: the pass checks, then the pool evicts the least recently used capsule and
    copies (the path without the slot in the pass); every kept capsule restores verified."""
    from test.engine_util import observations

    eng = _cuda_engine(capsule_slots=2)
    caps = []
    for i, o in enumerate(observations(4, seed=3)):
        eng.step(o)
        caps.append(eng.checkpoint(name=f"k{i}"))
    assert [c.name for c in eng.capsules()] == ["k2", "k3"]
    for c in caps[2:]:
        assert eng.restore(c.name, verify=True).checksum == c.checksum


def test_host_tier_spill_save_and_pin_back_on_cuda(tmp_path):
    """The host tier on CUDA: a spill is a queued copy into a pinned row; save_capsule waits for
    it before writing the file, and pinning brings the capsule back into a device slot (the one
    evicted for it spilling into its host row). Every byte survives each move."""
    from test.engine_util import observations

    eng = _cuda_engine(capsule_slots=2, host_capsule_slots=1)
    obs = observations(40, seed=4)
    caps = {}
    for i, o in enumerate(obs[:3]):
        eng.step(o)
        caps[f"k{i}"] = eng.checkpoint(name=f"k{i}")
    tiers = {i.name: i.tier for i in eng.capsules()}
    assert tiers == {"k0": "host", "k1": "gpu", "k2": "gpu"}
    path = eng.save_capsule("k0", tmp_path / "k0.fcap")  # right after its spill was queued
    info = eng.pin("k0")  # back into k1's slot; k1 spills into k0's host row
    assert info.pinned and info.tier == "gpu" and info.checksum == caps["k0"].checksum
    assert {i.name: i.tier for i in eng.capsules()} == {"k0": "gpu", "k1": "host", "k2": "gpu"}
    eng.restore("k0", verify=True)
    a = [eng.step(o) for o in obs[3:20]]
    assert eng.load_capsule(path, name="k0_file").checksum == caps["k0"].checksum
    eng.restore("k0_file", verify=True)  # the file holds the spilled bytes, whole
    b = [eng.step(o) for o in obs[3:20]]
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    for name in {i.name for i in eng.capsules()} - {"k0_file"}:
        assert eng.restore(name, verify=True).checksum == caps[name].checksum
