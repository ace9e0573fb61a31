"""The latched `~/goal_applied`: the goal the live session holds, said after every change.

A planner that subscribes late reads the one latched message as the goal the robot heads for,
so the last message published must be the newest change. Changes are numbered under the
engine lock, where they happen; a message is published only if no newer change was published
before it. A request that moved the live session (restore, branch, reset, rewind, a committed
rollout) has its echo read and published after the replies are sent (`flush`, run by the
serving thread with the held log lines): the device read and the publish (~0.1 ms on the H200)
are no longer part of its round trip. DDS orders nothing across topics, so a client never
could count on the echo before the reply; it waits for the echo of what it asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from std_msgs.msg import Float64MultiArray


class GoalEcho:
    def __init__(self, publisher) -> None:
        self._pub = publisher
        self._order = threading.Lock()  # a check and its publish, one at a time
        self._changes = 0  # numbered with the engine lock held: the order the goal changed in
        self._said = 0  # the newest change published
        self._due = False  # a moved live session's goal waits for flush()

    def changed(self) -> int:
        """A change of the live session's goal (engine lock held): its number."""
        self._changes += 1
        return self._changes

    def moved(self) -> None:
        """The live session's state was replaced by a request (engine lock held): its goal is
        read and published by the next flush()."""
        self.changed()
        self._due = True

    def say(self, change: int, goal: Sequence[float]) -> bool:
        """Publish `goal` as of change number `change`, unless a newer one was published."""
        with self._order:
            if change <= self._said:
                return False
            self._said = change
            self._pub.publish(Float64MultiArray(data=[float(v) for v in goal]))
            return True

    def flush(self, ctl) -> None:
        """After the replies (engine lock not held): publish the goal the live session holds
        now, if a request moved it. A change in between is published by its own echo or read
        here, whichever is newer; `ctl` is the services' Control (lock, engine, live)."""
        if not self._due:
            return
        self._due = False
        with ctl.lock:
            eng = ctl.engine
            if eng is None:  # cleaned up since: the next configure says its own goal
                return
            change = self._changes
            goal = eng.get_goal(ctl.live).tolist()
        self.say(change, goal)
