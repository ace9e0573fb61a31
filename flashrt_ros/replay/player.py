"""The replay schedule, shared by the node replay (over DDS) and the offline one (Engine).

Walks a bag's input events in order: goals are applied before the observations that follow
them, each valid observation yields exactly one command, invalid samples are skipped and counted
(the node refuses them the same way), and --checkpoint-at N / --restore-at M checkpoint after N
commands, restore after M and rewind the input to where the checkpoint was taken.

Camera images (events of kind "image") go to the driver before the joint_states that follow
them; each joint_states then steps on the newest valid image of every camera, as the node's
observation trigger does. A joint_states that comes before every camera had a valid image in the
replay is skipped (not sent: the node could hold an image from before the replay). An invalid
image is skipped too; the camera keeps its previous one. The node's wall-clock staleness
(obs_timeout_s) is not replayed: in lockstep an image is milliseconds old when it is stepped on,
and --offline has no clock; a bag whose camera drops out for longer than obs_timeout_s replays
its old image. Images are not state (a capsule holds none), so a restore hands the driver again
the images it held at the checkpoint, and a replay from a capsule plays the images before it
first.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from flashrt_ros.obs.joints import JointMapper
from flashrt_ros.replay.bags import InputEvent


class Driver(Protocol):
    def goal(self, data: np.ndarray) -> None: ...
    def image(self, event: InputEvent) -> str: ...  # "" when taken, else why it was refused
    def observe(self, obs: np.ndarray, event: InputEvent) -> np.ndarray | None: ...
    def checkpoint(self) -> str: ...
    def restore(self, ref: str) -> None: ...
    def refused(self, event: InputEvent) -> None: ...
    def rewind_images(self, images: list[InputEvent]) -> None: ...  # hold exactly these


@dataclass
class ReplayResult:
    commands: list[tuple[int, np.ndarray]] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (event index, why)
    goals: int = 0
    restored_at: int | None = None


def play(
    events: list[InputEvent],
    mapper: JointMapper,
    driver: Driver,
    checkpoint_at: int | None = None,
    restore_at: int | None = None,
    rate: float = 0.0,
    progress: bool = False,
    goal_dim: int | None = None,
) -> ReplayResult:
    """Run the schedule; `rate` > 0 paces sends at that multiple of bag time (still lockstep)."""
    why = schedule_problem(events, mapper, checkpoint_at, restore_at)
    if why:
        raise ValueError(why)
    res = ReplayResult()
    cp_ref, cp_index, shift = None, 0, 0
    held: dict[str, int] = {}  # camera -> index of its newest image the driver took
    held_at_cp: dict[str, int] = {}
    i, total, t0 = 0, len(events), time.monotonic()
    bag0 = events[0].stamp_ns if events else 0
    next_report = 0.1
    while i < total:
        n = len(res.commands)
        if checkpoint_at is not None and cp_ref is None and n == checkpoint_at:
            cp_ref, cp_index, held_at_cp = driver.checkpoint(), i, dict(held)
        if restore_at is not None and res.restored_at is None and n == restore_at:
            driver.restore(cp_ref)
            # the images are the driver's, not the capsule's: back to those of the checkpoint
            driver.rewind_images([events[j] for j in sorted(held_at_cp.values())])
            held = dict(held_at_cp)
            res.restored_at = n
            shift = (events[i - 1].stamp_ns if i else 0) - events[cp_index].stamp_ns + 1
            i = cp_index
            continue
        ev = events[i]
        if rate > 0:
            wait = (ev.stamp_ns - bag0) / 1e9 / rate - (time.monotonic() - t0)
            if wait > 0:
                time.sleep(wait)
        if ev.kind == "goal":
            why = _bad_goal(ev.data, goal_dim, mapper.limit)
            if why:  # what the node refuses (no echo comes): left out, as the node did
                res.skipped.append((i, why))
                driver.refused(ev)
            else:
                driver.goal(ev.data)
                res.goals += 1
        elif ev.kind == "image":
            why = driver.image(ev)
            if why:
                res.skipped.append((i, why))
            else:
                held[ev.camera] = i
        else:
            try:
                obs = mapper.observation(ev.names, ev.position, ev.velocity, ev.effort)
            except ValueError as e:
                res.skipped.append((i, str(e)))
                driver.refused(ev)
            else:
                cmd = driver.observe(obs, ev)
                if cmd is None:
                    res.skipped.append((i, "before the first valid image of every camera"))
                else:
                    res.commands.append((ev.stamp_ns + shift, cmd))
        i += 1
        if progress and total > 200 and i / total >= next_report:
            print(f"  {100 * i // total:3d}%  {len(res.commands)} commands", file=sys.stderr)
            next_report += 0.1
    if restore_at is not None and res.restored_at is None:
        raise ValueError(
            f"--restore-at {restore_at}: the bag has only {len(res.commands)} valid "
            f"observations, and a restore after {restore_at} commands needs more than that"
        )
    if not res.commands:  # an empty command bag, which a diff against another calls equal
        reasons = sorted({why for _, why in res.skipped})
        raise ValueError(
            f"no joint_states of the bag got a command ({len(res.skipped)} inputs refused: "
            f"{'; '.join(reasons[:3]) or 'none'}): nothing to compare; fix the bag or the "
            "policy's inputs"
        )
    return res


def schedule_problem(
    events: list[InputEvent],
    mapper: JointMapper,
    checkpoint_at: int | None = None,
    restore_at: int | None = None,
) -> str:
    """What makes the bag unplayable as asked ("" when nothing), found before anything is
    sent: no joint_states that would get a command (a replay of it would write an empty
    command bag, which a diff against another empty one calls equal), or a --restore-at at or
    beyond the number of those. A joint_states gets a command when the mapper takes it and
    every camera of the bag has had an image before it (play() skips the others); an image
    the node refuses is only found while playing."""
    why = checkpoint_problem(checkpoint_at, restore_at)
    if why:
        return why
    cameras = {ev.camera for ev in events if ev.kind == "image"}
    seen: set[str] = set()
    n_js = mapped = valid = 0
    first_why = ""
    for ev in events:
        if ev.kind == "image":
            seen.add(ev.camera)
        if ev.kind != "joint_states":
            continue
        n_js += 1
        try:
            mapper.observation(ev.names, ev.position, ev.velocity, ev.effort)
        except ValueError as e:
            first_why = first_why or str(e)
            continue
        mapped += 1
        valid += seen >= cameras
    if not n_js:
        return "the bag has no joint_states on the topic read: nothing to replay"
    if not mapped:
        return (
            f"none of the bag's {n_js} joint_states makes an observation for joints "
            f"{mapper.joint_names} ({'/'.join(mapper.fields)}); the first: {first_why}"
        )
    if not valid:
        return f"none of the bag's {n_js} joint_states comes after an image of every camera"
    if restore_at is not None and restore_at >= valid:
        return (
            f"--restore-at {restore_at}: the bag has {valid} valid observations, and a restore "
            f"after {restore_at} commands needs more than that"
        )
    return ""


def checkpoint_problem(checkpoint_at: int | None, restore_at: int | None) -> str:
    """What is wrong with --checkpoint-at / --restore-at ("" when nothing)."""
    if (checkpoint_at is None) != (restore_at is None):
        return "--checkpoint-at and --restore-at go together"
    if checkpoint_at is not None and not 0 <= checkpoint_at < restore_at:
        return "need 0 <= checkpoint-at < restore-at"
    return ""


def _bad_goal(data: np.ndarray, goal_dim: int | None, limit: float) -> str:
    """Why the node would refuse this goal ("" when it takes it)."""
    if goal_dim is not None and len(data) != goal_dim:
        return f"goal of {len(data)} values, the node takes {goal_dim}"
    if not np.isfinite(data).all():
        return "goal with NaN/Inf"
    if len(data) and float(np.abs(data).max()) > limit:
        return f"goal beyond |x| <= {limit:g} (obs_limit)"
    return ""


STAMP_SLACK_NS = 1000  # a capsule header keeps its stamp as float seconds: ~0.2 us of rounding


def events_after(events: list[InputEvent], stamp: float) -> tuple[list[InputEvent], int]:
    """The events after the last joint_states consumed by a capsule stamped `stamp` (seconds:
    the header stamp of that joint_states, or its receive time when it had none), and how many
    joint_states come before them. stamp 0 (step 0: nothing consumed yet) keeps every event.
    Goals before that point are already in the capsule's state, so they are left out too; the
    camera images before it are not (the capsule holds no image), so they lead the events: the
    first step after the capsule sees the newest valid image of every camera, as the node did.

    A joint_states whose header stamp is the capsule's is the point; two or more make it
    ambiguous, refused (taking the last one before the stamp started a replay one message off
    where stamps repeat, and far off where they go back). With none, the capsule's tick had an
    unstamped message, which the node stamped by its receive time, which no bag holds: the
    point is the last unstamped one recorded at or before it (none at all: another run; two
    recorded at that one time: ambiguous, refused as well)."""
    if stamp <= 0:
        return list(events), 0
    target = round(stamp * 1e9)
    states = [(i, e) for i, e in enumerate(events) if e.kind == "joint_states"]
    hits = [i for i, e in states if e.header_ns > 0 and abs(e.header_ns - target) <= STAMP_SLACK_NS]
    if len(hits) > 1:
        n = [j for j, _ in states]
        raise ValueError(
            f"{len(hits)} joint_states of the bag (numbers "
            f"{', '.join(str(n.index(i) + 1) for i in hits[:5])}) carry the capsule's stamp "
            f"{stamp:.9f} s: which one the capsule consumed is ambiguous (repeated header "
            "stamps); replay the whole bag, without --from-capsule"
        )
    unstamped = [(i, e) for i, e in states if e.header_ns <= 0]
    if hits:
        last = hits[0]
    elif unstamped:  # a tick of an unstamped message: its receive time, the nearest record
        last = max((i for i, e in unstamped if e.stamp_ns <= target + STAMP_SLACK_NS), default=-1)
        if last < 0:
            raise ValueError(
                f"the bag has no joint_states at or before the capsule's stamp {stamp:.9f} s: "
                "it does not hold the run the capsule comes from"
            )
        at = events[last].stamp_ns
        tied = [i for i, e in unstamped if abs(e.stamp_ns - at) <= STAMP_SLACK_NS]
        if len(tied) > 1:  # recorded at one time: which of them the capsule had is unknown
            n = [j for j, _ in states]
            raise ValueError(
                f"{len(tied)} unstamped joint_states of the bag (numbers "
                f"{', '.join(str(n.index(i) + 1) for i in tied[:5])}) were recorded at "
                f"{at / 1e9:.9f} s, the last time at or before the capsule's stamp "
                f"{stamp:.9f} s: which one the capsule consumed is ambiguous (repeated "
                "receive times); replay the whole bag, without --from-capsule"
            )
    else:
        raise ValueError(
            f"no joint_states of the bag carries the capsule's stamp {stamp:.9f} s: it "
            "does not hold the run the capsule comes from"
        )
    rest = events[last + 1 :]
    if not any(e.kind == "joint_states" for e in rest):
        raise ValueError(
            f"the bag has no joint_states after the capsule's stamp {stamp:.9f} s: "
            "nothing to replay"
        )
    images = [e for e in events[: last + 1] if e.kind == "image"]
    return images + rest, sum(e.kind == "joint_states" for e in events[: last + 1])


class EngineDriver:
    """Offline: the same schedule straight into an Engine (no DDS). For a policy with image
    inputs, each step gets a dict observation: the state and the newest valid image of each
    camera, checked by the node's own checks (obs/images.py image_array)."""

    def __init__(self, engine):
        from flashrt_ros.obs.images import camera_key, image_names

        self.engine = engine
        self._key = camera_key
        spec = engine.observation_spec()
        self.cameras = image_names(spec)
        self._spec = {n: spec[camera_key(n)] for n in self.cameras}
        self._state_key = next(k for k, v in spec.items() if v["kind"] == "vector")
        self._latest: dict[str, np.ndarray] = {}

    def goal(self, data: np.ndarray) -> None:
        self.engine.set_goal(data)

    def image(self, event: InputEvent) -> str:
        from flashrt_ros.errors import BadRequest
        from flashrt_ros.obs.images import image_array

        s = self._spec.get(event.camera)
        if s is None:
            return f"camera {event.camera!r} is not an image input of the policy"
        try:
            self._latest[event.camera] = image_array(
                event.image, tuple(s["shape"]), s["encoding"], f"camera {event.camera!r}"
            )
        except BadRequest as e:
            return str(e)
        return ""

    def observe(self, obs: np.ndarray, event: InputEvent) -> np.ndarray | None:
        if not self.cameras:
            return self.engine.step(obs)
        if len(self._latest) < len(self.cameras):
            return None  # before every camera had an image: skipped, as the node replay does
        x = {self._state_key: obs}
        for n in self.cameras:
            x[self._key(n)] = self._latest[n]
        return self.engine.step(x)

    def checkpoint(self) -> str:
        return self.engine.checkpoint().id

    def restore(self, ref: str) -> None:
        self.engine.restore(ref)

    def rewind_images(self, images: list[InputEvent]) -> None:
        self._latest = {}
        for ev in images:
            self.image(ev)

    def refused(self, event: InputEvent) -> None:
        pass  # the engine never sees what the mapper refused, like the node
