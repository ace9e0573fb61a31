"""The build's check that a policy's step is a function of its arena and its inputs alone.

A capsule holds the arena. Whatever else a step depends on is not in it: a Python attribute
the step counts with, a buffer of the module's own that it updates, a state tensor replaced
(`state["h"] = new`) instead of written in place, torch's or Python's global random
generators. A restore, branch, rewind or reset then continues differently while every
checksum agrees, and nothing says so (a policy author's review: all of these served, and
`reset` did not even reset the replaced tensor). So before anything is captured, the first
session steps each tick kind twice from the same arena and inputs, eagerly: a state view the
step replaced, or outputs (arena, action, chunk) that differ by a bit, refuse the policy,
saying which and why. A policy whose kernels are not deterministic (atomics) may opt out with
`Policy.probe_purity = False`, and its capsules then continue only approximately.

The LeRobot adapter checks its module's predict_action_chunk the same way (chunked.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from flashrt_ros.errors import BadRequest

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
    kinds: Iterable[int],
    run: Callable[[int], None],
    views: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor],
    keep: list[torch.Tensor],
    inputs: list[torch.Tensor],
) -> None:
    """Run `run(kind)` twice per kind from the buffers in `keep` as they are and the input
    buffers `inputs` (also in `keep`) filled with example values; BadRequest when a view of
    `views` was replaced or an output of `outputs` differs. Everything in `keep` is put back
    after, and `views` too."""
    saved = [t.clone() for t in keep]
    before = dict(views)
    try:
        example_inputs(inputs)
        saved_inputs = [t.clone() for t in inputs]
        for kind in kinds:
            got = []
            for _ in range(2):
                with torch.no_grad():
                    for t, s in zip(keep, saved, strict=True):
                        t.copy_(s)
                    for t, s in zip(inputs, saved_inputs, strict=True):
                        t.copy_(s)
                    try:
                        run(kind)
                    except Exception as e:  # a step that cannot run: say so at build
                        raise BadRequest(
                            f"{policy_id}: its step"
                            + (f" (tick kind {kind})" if kind else "")
                            + f" fails on example inputs: {type(e).__name__}: {e}"
                        ) from e
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
                    f"{policy_id}: two steps from the same state and inputs differ in "
                    f"{', '.join(differ)}"
                    + (f" (tick kind {kind})" if kind else "")
                    + ": the step keeps state outside the arena (a Python attribute, a buffer "
                    "of its own) or draws randomness of its own (torch.rand*, random, numpy), "
                    f"which no capsule can hold; {HOW}"
                )
    finally:
        views.clear()
        views.update(before)
        with torch.no_grad():
            for t, s in zip(keep, saved, strict=True):
                t.copy_(s)
