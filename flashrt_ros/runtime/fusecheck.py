"""Check a compiled (fused) step against the eager step before it is captured and served.

Inductor has been seen to compute a value that reads the arena through a dtype view after a
later write to the arena, so the compiled step read the state one write too late
(pytorch/pytorch#198101, open; docs/design.md, "Checking the fused step"). Our own step avoids
the pattern we hit, but a policy's own step may hold another. A robot must never get a
miscompiled action, so before a fused step is captured, each tick kind runs both ways from the
same state and inputs, and any difference beyond float reassociation means the step is served
from its eager kernels instead (the caller logs why).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

MAX_TICKS = 256  # a chunked policy's first re-inference comes n_action_steps ticks in
SEEN = 2  # each tick kind is checked this many times (or until MAX_TICKS), and at least
# Policy.check_ticks ticks (an ensembling queue fills up in chunk_len ticks)


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(absolute, relative to the largest magnitude) allowed between fused and eager values:
    fused kernels reassociate float sums and keep intermediates in float32."""
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2, 5e-2
    return 1e-4, 1e-3


def differs(got: torch.Tensor, want: torch.Tensor) -> str:
    """How `got` differs from `want` beyond reassociation ("" when it does not); other
    values (integers, booleans) must be equal, NaN matches NaN."""
    if not want.dtype.is_floating_point:
        bad = int((got != want).sum())
        return f"{bad} of {want.numel()} values differ" if bad else ""
    g, w = got.double(), want.double()
    both_nan = torch.isnan(g) & torch.isnan(w)
    diff = torch.where(both_nan, torch.zeros_like(g), (g - w).abs()).nan_to_num(float("inf"))
    finite = w[torch.isfinite(w)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    atol, rtol = _tolerance(want.dtype)
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst > atol + rtol * scale:
        return f"max difference {worst:.3g} (values up to {scale:.3g})"
    return ""


def randomize(inputs: dict[str, torch.Tensor], names: Sequence[str], g: torch.Generator) -> None:
    """Fill the input buffers `names` with plausible random values: floats ~ N(0, 0.5),
    uint8 buffers (camera images) over their whole range."""
    for n in names:
        t = inputs[n]
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=g) * 0.5)
        elif t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))


def check_fused(
    kinds: Callable[[int], int],
    run: Callable[[int, bool], None],
    advance: Callable[[], None],
    tick_inputs: list[tuple[str, ...]],
    inputs: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor],
    min_ticks: int = 0,
) -> str:
    """Step fused and eager from the same state, kind by kind; the first difference ("" when
    none). `kinds(step)` is the tick kind of a step, `run(kind, fused)` one policy step over the
    session's buffers, `advance()` the step counter, `outputs` every buffer the step writes
    (arena views by name, action, chunk, the flight ring where the step writes it); at least
    `min_ticks` ticks (MAX_TICKS at most). The caller saves and restores the buffers."""
    g = torch.Generator().manual_seed(0)
    seen: dict[int, int] = {}
    n_kinds = len(tick_inputs)
    with torch.no_grad():
        for step in range(MAX_TICKS):
            if len(seen) == n_kinds and min(seen.values()) >= SEEN and step >= min_ticks:
                break
            kind = kinds(step)
            seen[kind] = seen.get(kind, 0) + 1
            randomize(inputs, tick_inputs[kind], g)
            start = {n: t.clone() for n, t in outputs.items()}
            run(kind, True)
            got = {n: t.clone() for n, t in outputs.items()}
            for n, t in outputs.items():
                t.copy_(start[n])
            run(kind, False)  # the eager step leads: the next tick starts from its state
            for n, t in outputs.items():
                why = differs(got[n], t)
                if why:
                    return f"tick kind {kind} at step {step}: {n!r}: {why}"
            advance()
    return ""
