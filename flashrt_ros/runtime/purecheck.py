"""The build's check that a policy's step is a function of its arena and its inputs alone.

A capsule holds the arena. Whatever else a step depends on is not in it: a Python attribute
the step counts with, a buffer of the module's own that it updates, a state tensor replaced
(`state["h"] = new`) instead of written in place, torch's or Python's global random
generators. A restore, branch, rewind or reset then continues differently while every
checksum agrees, and nothing says so (a policy author's review: all of these served, and
`reset` did not even reset the replaced tensor). So before anything is captured, the first
session steps in the policy's own tick order, each tick twice from the same arena and
inputs, eagerly, until every tick kind ran: a state view the step replaced, or outputs (arena,
action, chunk) that differ by a bit, refuse the policy, saying which and why. A policy whose
kernels are not deterministic (atomics) may opt out with `Policy.probe_purity = False`, and its
capsules then continue only approximately.

The LeRobot adapter checks its module's predict_action_chunk the same way (chunked.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashrt_ros.errors import BadRequest, CapacityError
from flashrt_ros.runtime.fusecheck import MAX_TICKS

HOW = (
    "a step may depend only on the arena (its state_spec) and its inputs: keep every state in "
    "a region of state_spec, written in place (state[name].copy_(...)), and draw noise with "
    "flashrt_ros.policies.rng from a counter in the arena (README: writing a policy; set "
    "probe_purity = False only for kernels that are not deterministic)"
)


def example_inputs(inputs: list[torch.Tensor]) -> None:
    """Fixed example values, not the zeros input buffers start with: a step that scales its
    input by a hidden counter or a random draw gives the same zeros every time."""
    g = torch.Generator().manual_seed(7)
    for t in inputs:
        if t.dtype.is_floating_point:
            x = torch.rand(t.shape, generator=g) - 0.5
        else:
            x = torch.randint(0, 256, t.shape, generator=g)
        t.copy_(x.to(t.dtype))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def check_pure(
    policy_id: str,
    kinds: Callable[[int], int],
    n_kinds: int,
    run: Callable[[int], None],
    advance: Callable[[], None],
    views: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor],
    keep: list[torch.Tensor],
    inputs: list[torch.Tensor],
) -> None:
    """Step in the policy's own tick order (`kinds(step)`, `advance()` the counter) from the
    buffers in `keep` as they are, the input buffers `inputs` (also in `keep`) holding example
    values, until every one of the `n_kinds` kinds ran (MAX_TICKS at most): each tick runs
    twice from the same state. BadRequest when a view of `views` was replaced, an output of
    `outputs` differs, or the step raises. Everything in `keep` is put back after, and `views`.
    A kind runs only on a state its own order brings it (a queue tick after an infer tick), as
    in service: a pop from the initial state may index out of range."""
    saved = [t.clone() for t in keep]
    before = dict(views)
    try:
        example_inputs(inputs)
        fixed = [t.clone() for t in inputs]
        seen: set[int] = set()
        for step in range(MAX_TICKS):
            if len(seen) == n_kinds:
                break
            kind = kinds(step)
            seen.add(kind)
            at = [t.clone() for t in keep]  # the state this tick starts from
            got = []
            for _ in range(2):
                with torch.no_grad():
                    for t, s in zip(keep, at, strict=True):
                        t.copy_(s)
                    for t, s in zip(inputs, fixed, strict=True):
                        t.copy_(s)
                    _run(policy_id, run, kind, step)
                replaced = [n for n, v in views.items() if v is not before.get(n)]
                if replaced:
                    raise BadRequest(
                        f"{policy_id}: its step replaced state {', '.join(map(repr, replaced))} "
                        "instead of writing it in place, so the new tensor is outside the arena "
                        f"that capsules, restore and reset hold; {HOW}"
                    )
                got.append({n: _bytes(t).clone() for n, t in outputs.items()})
            differ = [n for n in outputs if not torch.equal(got[0][n], got[1][n])]
            if differ:
                raise BadRequest(
                    f"{policy_id}: two steps from the same state (step {step}"
                    + (f", tick kind {kind}" if n_kinds > 1 else "")
                    + f") and inputs differ in {', '.join(differ)}: the step keeps state outside "
                    "the arena (a Python attribute, a buffer of its own) or draws randomness of "
                    f"its own (torch.rand*, random, numpy), which no capsule can hold; {HOW}"
                )
            with torch.no_grad():
                advance()
    finally:
        views.clear()
        views.update(before)
        with torch.no_grad():
            for t, s in zip(keep, saved, strict=True):
                t.copy_(s)


def _run(policy_id: str, run: Callable[[int], None], kind: int, step: int) -> None:
    """One tick of the probe; a step that raises is refused at build, saying where."""
    try:
        run(kind)
    except torch.OutOfMemoryError as e:  # a bound, not the policy's fault
        raise CapacityError(f"{policy_id}: out of memory in the build's first steps: {e}") from e
    except Exception as e:
        raise BadRequest(
            f"{policy_id}: its step fails on the state at step {step} (kind {kind}) and "
            f"example inputs: {type(e).__name__}: {e}"
        ) from e
