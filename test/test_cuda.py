"""The CUDA-path checks as assertions, on the GPU machine (no ROS needed):

    FLASHRT_REQUIRE_CUDA=1 python3 -m pytest -q -m cuda test/test_cuda.py

The checks are written once, in bench/checks.py (bench/run_all.py and bench/cuda_check.py record
the same ones in their JSON and fail on them). Each test runs one group and fails naming every
failed check with what it measured. Where torch sees no CUDA device these tests are skipped
(conftest.py); bench.checks is imported only by a test that runs.
"""

from __future__ import annotations

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
