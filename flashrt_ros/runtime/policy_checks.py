"""What a Policy declares, checked before the Engine allocates anything for it.

A policy author's review found a declaration's mistakes surfacing as raw torch or Python errors
(a negative shape: RuntimeError from the arena; a dtype given as a string: TypeError), or not
at all: a second vector input dropped when the policy takes one vector, an `obs_dim` that
disagrees with its input, weights kept as plain tensor attributes that the engine fingerprint
never sees. Each is now a BadRequest naming the field, or a warning for the last.
"""

from __future__ import annotations

import logging
import numbers

import torch

from flashrt_ros.errors import BadRequest
from flashrt_ros.policies.base import ROLES, Policy, StateEntry

log = logging.getLogger("flashrt_ros.engine")

ENGINE_REGIONS = ("goal", "step", "meta")  # runtime/session.engine_entries adds them


def _count(policy: Policy, name: str, lo: int) -> int:
    v = getattr(policy, name, None)  # numpy's integers too (obs_dim = np.prod(shape))
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise BadRequest(
            f"{policy.policy_id}: {name} must be an integer >= {lo} (a class or instance "
            f"attribute of the policy), got {v!r}"
        )
    return v


def check_declaration(policy: Policy) -> list[StateEntry]:
    """The policy's state_spec, checked with its sizes; BadRequest naming what is wrong."""
    pid = getattr(policy, "policy_id", type(policy).__name__)
    for name, lo in (("obs_dim", 0), ("action_dim", 1), ("goal_dim", 0), ("chunk_len", 1)):
        _count(policy, name, lo)
    try:
        spec = policy.state_spec()
    except NotImplementedError:
        raise BadRequest(f"{pid}: state_spec() is not written (a list of StateEntry)") from None
    if not isinstance(spec, list | tuple):
        raise BadRequest(f"{pid}: state_spec() must return a list of StateEntry, got {spec!r}")
    names = [getattr(e, "name", None) for e in spec]
    for i, e in enumerate(spec):
        where = f"{pid}: state_spec()[{i}]"
        if not isinstance(e, StateEntry):
            raise BadRequest(f"{where} is {type(e).__name__}, not a StateEntry")
        if not isinstance(e.name, str) or not e.name:
            raise BadRequest(f"{where}: the name must be a non-empty string, got {e.name!r}")
        if e.name in ENGINE_REGIONS:
            raise BadRequest(
                f"{where}: {e.name!r} is a region the Engine adds itself "
                f"({', '.join(ENGINE_REGIONS)}; the goal is goal_dim floats): name yours otherwise"
            )
        if not isinstance(e.dtype, torch.dtype):
            raise BadRequest(f"{where} ({e.name!r}): dtype must be a torch.dtype, got {e.dtype!r}")
        if names.count(e.name) > 1:
            raise BadRequest(f"{where}: the name {e.name!r} is declared more than once")
        if e.role not in ROLES:
            raise BadRequest(f"{where} ({e.name!r}): role must be one of {ROLES}, got {e.role!r}")
        shape = tuple(e.shape) if isinstance(e.shape, list | tuple) else None
        if shape is None or not all(type(d) is int and d >= 0 for d in shape):
            raise BadRequest(
                f"{where} ({e.name!r}): shape must be a tuple of integers >= 0, got {e.shape!r}"
            )
    return list(spec)


def check_inputs(policy: Policy, inputs: list) -> None:
    """A policy that takes one vector (takes_dict False) gets exactly that vector: a second
    input was staged and never reached it, and an obs_dim other than the vector's size made a
    wrong-size vector pass one check and fail another."""
    if policy.takes_dict:
        return
    pid = policy.policy_id
    if len(inputs) != 1 or inputs[0].kind != "vector":
        raise BadRequest(
            f"{pid}: a policy whose step takes one vector (takes_dict False) declares one vector "
            f"input, got {[(i.name, i.kind) for i in inputs]}: set takes_dict = True to get "
            "them all as a dict"
        )
    if tuple(inputs[0].shape) != (policy.obs_dim,):
        raise BadRequest(
            f"{pid}: obs_dim is {policy.obs_dim} but its input {inputs[0].name!r} has shape "
            f"{tuple(inputs[0].shape)}"
        )


def warn_unregistered_tensors(policy: Policy) -> list[str]:
    """Tensors outside the state dict, logged: plain tensor attributes and buffers registered
    with persistent=False. The engine fingerprint (weights_digest) reads the state dict only, so
    a capsule of other such weights would load and restore unseen. A module names those it
    computes from its configuration (index ranges, schedules, grids) in its class attribute
    `derived_buffers`: weights_digest reads them too, so they are not warned about."""
    found = []
    for prefix, m in policy.named_modules():
        at = f"{prefix}." if prefix else ""
        derived = set(getattr(m, "derived_buffers", ()))
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and not k.startswith("_") and k not in derived:
                found.append(at + k)
        nonpersistent = getattr(m, "_non_persistent_buffers_set", ())
        found += [at + k for k in nonpersistent if k not in derived]
    if found:
        log.warning(
            "%s: tensor(s) %s are outside the state dict (a plain attribute, or a buffer "
            "registered with persistent=False): the engine fingerprint does not cover them, so "
            "capsules of other values would load; register them (register_buffer, persistent) "
            "if they are weights",
            policy.policy_id,
            ", ".join(found),
        )
    return found
