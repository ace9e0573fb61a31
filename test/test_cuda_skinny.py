"""The few-row linear kernel (cuda/skinny.py) on the GPU machine:

    FLASHRT_REQUIRE_CUDA=1 python3 -m pytest -q -m cuda test/test_cuda_skinny.py

It must compute F.linear (to float rounding), give the same bits on every call (no atomics), be
what the lerobot-size diffusion UNet uses, and fall back to F.linear for what it does not take.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from flashrt_ros.cuda import skinny

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(
    "m,k,n,bias",
    [
        (16, 2560, 512, True),
        (8, 5120, 1024, True),
        (4, 10240, 2048, False),
        (1, 1024, 300, True),
        (3, 516, 7, True),
        (5, 2048, 1001, False),
    ],
)
def test_equals_linear_and_repeats_bit_for_bit(m, k, n, bias):
    g = torch.Generator(device="cuda").manual_seed(m * n)
    x = torch.randn(1, m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    b = torch.randn(n, device="cuda", generator=g) if bias else None
    assert skinny.function(0, m) is not None, "the kernel must build on the GPU machine"
    y = skinny.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert skinny._usable(x, w, b)  # the kernel computed it, not the fallback
    for _ in range(3):  # the same bits every time
        assert torch.equal(skinny.linear(x, w, b), y)


def test_captured_in_a_graph():
    x = torch.randn(4, 4096, device="cuda")
    w = torch.randn(2048, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        skinny.linear(x, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny.linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-3)


def test_falls_back_where_it_does_not_apply():
    w = torch.randn(64, 1024, device="cuda")
    for x in (
        torch.randn(17, 1024, device="cuda"),  # too many rows
        torch.randn(1024, 4, device="cuda").t(),  # strided
        torch.randn(2, 1024, device="cuda", dtype=torch.float64),  # another dtype
        torch.randn(2, 1024),  # the CPU
    ):
        ww = w.to(x.device, x.dtype)
        assert torch.equal(skinny.linear(x, ww), F.linear(x, ww))
    x = torch.randn(2, 1024, device="cuda")
    one = torch.randn(1, device="cuda")  # a bias F.linear broadcasts: never read past its end
    assert torch.equal(skinny.linear(x, w, one), F.linear(x, w, one))
    none = torch.randn(0, 1024, device="cuda")  # no outputs at all
    assert skinny.linear(x, none).shape == (2, 0)
    wg = w.clone().requires_grad_(True)  # training: the kernel has no backward
    skinny.linear(x, wg).sum().backward()
    torch.testing.assert_close(wg.grad, x.sum(0).expand_as(w))


def test_compiles_as_one_opaque_op():
    x = torch.randn(8, 2048, device="cuda")
    w = torch.randn(512, 2048, device="cuda")
    fn = torch.compile(lambda a, b: torch.relu(skinny.linear(a, b)), fullgraph=True)
    torch.testing.assert_close(fn(x, w), torch.relu(F.linear(x, w)), rtol=1e-4, atol=1e-3)
