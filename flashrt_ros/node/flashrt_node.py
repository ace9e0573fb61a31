"""The flashrt LifecycleNode: the control loop, the command outputs and the capsule services.

Threads: rclpy's executor runs only the lifecycle and parameter services and the 1 Hz diagnostics
timer (diagnostics.py). The subscriptions are never its (polled.py): from configure to cleanup
(main.py: after the autostart transitions) the inputs' loop (inputs.py, thread `flashrt-inputs`)
takes the goal and, in observation mode, the images and joint_states (each joint_states a step, on
that thread; with `step_on` naming cameras, a step once every listed input has a new valid message,
on the thread that took the last of them: `_step_if_due`, so a camera-paced policy steps as its
frames land, not at the next joint_states); the timer trigger runs its own thread
(`flashrt-control`, loop.py), which takes joint_states and the images itself at the top of each
tick and publishes /diagnostics in its slack. The services run on a node and a loop of their own
(host.py, main.py), served by the thread that steps: the control thread between two ticks while the
timer loop runs, the inputs' thread between two observations in observation mode, else a thread of
their own. A rollout steps on a thread of its own (services.py). Every Engine call holds the engine
lock (loop.EngineLock), so a service request always lands between two steps; the control tick goes
first, and a rollout steps only where no tick is due.

Safety: nothing non-finite is ever published. A step that produces a NaN/Inf action (or fails on
the device) is a fault: nothing is published, it is counted and logged, /diagnostics goes ERROR,
and the session stays poisoned (no step, no command) until ~/reset_session, ~/restore or
~/branch puts a good state back into it.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from rclpy.qos import QoSDurabilityPolicy, QoSProfile, qos_profile_sensor_data
from rclpy.serialization import deserialize_message
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory

from flashrt_ros.capsules.folder_lock import FolderLock
from flashrt_ros.node import params
from flashrt_ros.node.convert import command_msg, trajectory_msg
from flashrt_ros.node.diagnostics import Diagnostics
from flashrt_ros.node.engine_build import make_engine
from flashrt_ros.node.flight_services import FlightServices
from flashrt_ros.node.goal_echo import GoalEcho
from flashrt_ros.node.host import ServiceHost
from flashrt_ros.node.inputs import InputLoop
from flashrt_ros.node.logs import Throttle
from flashrt_ros.node.loop import (
    SPIN_S,
    ThreadUsage,
    TimerLoop,
    set_affinity,
    set_realtime,
    throttle_note,
)
from flashrt_ros.node.polled import PolledGroup, take
from flashrt_ros.node.qos_check import (
    QOS_OVERRIDES,
    input_qos,
    unmatched,
    warn_unused_qos_overrides,
)
from flashrt_ros.node.services import CapsuleServices, Control, pool_bytes
from flashrt_ros.node.stats import LoopStats
from flashrt_ros.obs.joints import JointMapper
from flashrt_ros.runtime.engine import Engine

# The start-up log's entries for the engine's making (a later configure's replace them)
ENGINE_PHASES = ("policy load", "engine ")

# The parts of a timer tick, between its marks (FlashrtNode._step): taking the inputs, waiting for
# the engine lock, the step, the wait for publish_offset_s, publishing (`last_overrun` gives them).
TICK_PARTS = ("inputs", "lock", "step", "offset", "publish")
FUSE_WAIT_S = 300.0  # cleanup waits this long for a fused step still building
EXIT_FUSE_WAIT_S = 5.0  # and an exit this long, once the build was cancelled
STOP_DUMP_WAIT_S = 1.0  # a signal's flight dump waits this long for the engine, no longer


def _says_why(transition: Callable) -> Callable:
    """Log the traceback of a transition that raises, then let rclpy have it: rclpy turns it
    into an error transition (on_error) without a word."""

    @functools.wraps(transition)
    def run(self, state):
        try:
            return transition(self, state)
        except Exception:
            self.get_logger().error(f"{transition.__name__} raised:\n{traceback.format_exc()}")
            raise

    return run


class FlashrtNode(LifecycleNode):
    # how long /diagnostics waits for the engine lock: a status without the engine's fields
    # (and saying why) beats none while a step or request is stuck holding it
    ENGINE_WAIT_S = 0.25

    def __init__(self, **kwargs):
        super().__init__("flashrt", **kwargs)
        params.declare(self)
        self.cfg: params.NodeConfig | None = None
        self.active = False
        # the last tick's times (monotonic), preallocated: nothing allocated per tick for them;
        # _marked of them are this tick's (fewer on an early return), _offset: a publish offset
        self._marks = [0.0] * (len(TICK_PARTS) + 1)
        self._tick_usage = ThreadUsage()  # the control thread's CPU and switches per tick
        self._started_late = False  # this tick began late: the one before ran into its period
        self._marked, self._offset = 0, False
        self.stats = LoopStats()
        # the services' (and diagnostics') view of the node: engine, live session, lock, stats
        self.control = Control(self.stats, self.get_logger(), lambda: self.cfg)
        self.mapper: JointMapper | None = None
        self._obs_lock = threading.Lock()
        self._latest_obs: np.ndarray | None = None
        self._latest_t = 0.0
        self._loop: TimerLoop | None = None
        self._inputs: InputLoop | None = None  # from configure to cleanup (inputs.py)
        self.defer_inputs = False  # configure leaves the start to start_inputs() (main.py)
        self._pub_cmd = self._pub_traj = None
        self._traj_running = False  # a trajectory went out since the last hold (_hold)
        self._traj_at = 0.0  # when the last one went out (monotonic)
        # output and hold in order: no step's output goes out after deactivate's hold. Reentrant:
        # the exit's hold (hold_for_exit) runs in a signal handler, which may interrupt the
        # main thread inside a hold of its own (deactivate)
        self._out_lock = threading.RLock()
        self._cb_services = ReentrantCallbackGroup()
        self._polled = PolledGroup()  # every subscription: none is the executor's (polled.py)
        self._js_sub = None
        self._subs = []
        self._cams = None  # node/cameras.py Cameras: camera/<name>/image_raw
        self._state_key = ""  # the policy's vector input, when it takes a dict observation
        self._stale_why = ""  # the stream a stale tick waited for
        self._refused_seen = 0  # refused inputs counted by the last /diagnostics
        self._refused_at = -1e9  # when a /diagnostics last saw that count grow
        self._refusal_logged_at = -1e9  # refused inputs are logged once per 2 s at most
        self._stale_at = float("-inf")  # when the last stale tick was
        self._ids_from = 1  # capsule ids below this were issued by an earlier engine
        self._overruns_seen = 0  # overruns counted by the last /diagnostics
        self._overrun_at = -1e9  # when a /diagnostics last saw that count grow much
        self._overruns_checked = time.monotonic()  # when the last /diagnostics looked
        self._overload_logged_at = -1e9  # the loop's overload is logged once per 10 s at most
        # observation trigger with step_on other than [joint_states] ("frame steps"): a step once
        # every step_on input has a new valid message; the inputs' counts at the last step
        self._frames = False
        self._per_message = False  # observation trigger, one step per joint_states message
        self._js_at = 0.0  # ...and when its last valid one was received (0.0: none yet)
        self._js_refused_at = 0.0  # ...and when the last one was refused
        self._unheard_logged: set[str] = set()  # publishers the QoS check has warned about
        self._frame_at = 0.0  # frame steps: when the last frame set was due (monotonic)
        self._frame_gap = 0.0  # and the time since the one before (a stale one's stale_s)
        self._due_lock = threading.Lock()
        self._stepped_at: tuple[int, ...] = ()
        self._js_taken = 0  # valid joint_states so far (frame steps count them)
        self.startup: dict[str, float] = {}  # phase -> seconds (main.py adds the imports)
        self._fuse_unlogged = False  # late fusing's end is not logged yet
        self.process_t0: float | None = None  # monotonic time the process started (main.py)
        self.context_warmer = None  # main.py's cuda/prewarm.ContextWarmer, if it made one
        self._stopped_active = False  # a signal stopped the node while active (hold_for_exit)
        self._twins_said = 1  # nodes of this name last seen on the graph (_same_name_nodes)
        self._uncounted = False  # the tick just run copied a fault's flight ring (_on_timing)
        # the services on a node of their own, spun by main.py on a thread of its own
        self.service_host = ServiceHost(self)
        self.service_host.on_served = self._served
        self.service_host.after_replies = self._after_replies
        self.capsule_services = CapsuleServices(self.control, self.service_host, self._cb_services)
        self.flight = FlightServices(self.control, self.service_host, self._cb_services)
        self.control.on_moved = self._on_moved
        self.control.on_dropped = self.flight.dropped
        self.diagnostics = Diagnostics(
            self, self.diagnostic_array, self.control.lock, group=self._cb_services
        )
        latched = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
        self._goal_echo = GoalEcho(
            self.create_publisher(Float64MultiArray, "~/goal_applied", latched)
        )
        self._dir_lock: FolderLock | None = None  # capsule_dir's, from configure to cleanup
        self._goal_lines = Throttle(2.0)  # "goal applied": one line per 2 s, with a count
        self._poison_lines = Throttle(60.0)  # the live session's poison, again once a minute

    def set_parameters_atomically(self, parameter_list) -> SetParametersResult:
        """A set naming a parameter the node does not have is refused with the names (and the
        parameter meant, when one is close); rclpy raises and its reason lists none. Both
        parameter services come here (SetParameters one parameter at a time)."""
        unknown = [p.name for p in parameter_list if not self.has_parameter(p.name)]
        if unknown:
            declared = sorted(self.get_parameters_by_prefix(""))
            reason = params.NODE_PARAMS.unknown_set(unknown, declared)
            self.get_logger().warning(f"parameter set refused: {reason}")
            return SetParametersResult(successful=False, reason=reason)
        was = {p.name: self.get_parameter(p.name).value for p in parameter_list}
        result = super().set_parameters_atomically(parameter_list)
        if not result.successful and result.reason.startswith("Wrong parameter type"):
            result.reason = params.NODE_PARAMS.type_refusal(parameter_list, result.reason)
        # an operator's change at runtime leaves a line in the log, accepted or not
        said = ", ".join(f"{p.name}={p.value!r} (was {was[p.name]!r})" for p in parameter_list)
        if result.successful:
            self.get_logger().info(f"parameters set: {said}")
        else:
            self.get_logger().warning(f"parameter set refused ({said}): {result.reason}")
        return result

    @property
    def engine(self) -> Engine | None:
        return self.control.engine

    @engine.setter
    def engine(self, engine: Engine | None) -> None:
        self.control.engine = engine

    @property
    def live(self) -> str:
        return self.control.live

    @live.setter
    def live(self, name: str) -> None:
        self.control.live = name

    @property
    def engine_lock(self):
        return self.control.lock

    # -- lifecycle ---------------------------------------------------------------------------------
    @_says_why
    def on_configure(self, state) -> TransitionCallbackReturn:
        try:
            cfg = params.read(self)
            t0 = time.monotonic()
            self.control.new_folder()
            for k in [k for k in self.startup if k.startswith(ENGINE_PHASES)]:
                del self.startup[k]  # a configure before this one's
            built = make_engine(cfg, self.get_fully_qualified_name())
            policy, mapper, cameras = built.policy, built.mapper, built.cameras
            state_key, engine, self._dir_lock = built.state_key, built.engine, built.lock
            self._warn_unlocked()
            # a planner may still hold the ids of this node's earlier engines: none is reissued
            engine.pool.skip_ids_below(self._ids_from)
        except (ValueError, RuntimeError, OSError) as e:
            self._unlock_capsule_dir()
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        except Exception as e:  # rclpy would turn it into ERROR without a word: say what it was
            self._unlock_capsule_dir()
            self.get_logger().error(f"configure failed: {type(e).__name__}: {e}")
            return TransitionCallbackReturn.FAILURE
        self.cfg, self.engine, self.mapper, self.live = cfg, engine, mapper, "main"
        with self.engine_lock:  # the latched echo of an engine before stays no longer
            change = self._goal_echo.changed()
            goal = engine.get_goal("main")
        self._goal_echo.say(change, goal)
        w = self.context_warmer
        if w is not None and engine.device.type != "cuda" and w.release():
            self.get_logger().info(
                f"the engine runs on {engine.device}: released the CUDA context made ahead"
            )
        self._fuse_unlogged = engine.fusing  # diagnostic_array logs the build's end
        self._pub_cmd = self._pub_traj = None
        self._traj_running = False
        if cfg.output in ("commands", "both"):
            self._pub_cmd = self.create_lifecycle_publisher(Float64MultiArray, "commands", 10)
        if cfg.output in ("joint_trajectory", "both"):
            self._pub_traj = self.create_lifecycle_publisher(
                JointTrajectory, "joint_trajectory", 10
            )
        self._state_key, self._cams = state_key, None
        timer = cfg.trigger == "timer"
        # frame steps: the joint_states is a sampled input, as in timer mode (newest wins)
        self._frames = frames = not timer and tuple(cfg.step_on) != ("joint_states",)
        self._per_message = not timer and not frames
        if cameras:
            # imported here: it loads rosbags' decoder, ~45 ms of start-up without cameras
            from flashrt_ros.node.cameras import Cameras

            try:
                self._cams = Cameras(
                    self,
                    cameras,
                    engine.observation_spec(),
                    self._refuse,
                    self._polled,
                    polled=timer,
                    qos=input_qos(qos_profile_sensor_data if timer else 10),
                    prestage=self._prestage,
                    on_new=self._step_if_due if frames else None,
                )
            except Exception as e:  # e.g. no decoder for compressed frames: say so, leave nothing
                self.get_logger().error(f"configure failed: cameras: {type(e).__name__}: {e}")
                self._release()  # the engine and publishers made so far
                return TransitionCallbackReturn.FAILURE
        # frame steps take the newest joint_states, yet keep the observation trigger's reliable
        # QoS, so both observation modes match the same joint_states publishers
        js_qos = qos_profile_sensor_data if timer else 10 if frames else 100
        try:  # a bad qos_overrides value raises here: say which, leave nothing
            for msg_type, topic, callback, qos in (
                (Float64MultiArray, "goal", self._on_goal, 10),
                (JointState, "joint_states", self._on_joint_states, js_qos),
            ):
                self._subs.append(
                    self.create_subscription(
                        msg_type,
                        topic,
                        callback,
                        input_qos(qos),
                        callback_group=self._polled,
                        qos_overriding_options=QOS_OVERRIDES,
                        # timer mode takes joint_states serialized: _take_newest_joint_states
                        raw=timer and topic == "joint_states",
                    )
                )
        except Exception as e:
            self.get_logger().error(
                f"configure failed: {topic}: {type(e).__name__}: {e} (its qos_overrides.* "
                "parameters take reliability reliable | best_effort, history keep_last | "
                "keep_all, depth an integer)"
            )
            self._release()  # the engine, publishers, cameras and subscriptions made so far
            return TransitionCallbackReturn.FAILURE
        warn_unused_qos_overrides(self)
        self._js_sub = self._subs[1]
        # timer mode: the control thread takes joint_states and the images itself
        drained = [self._subs[0]]  # the goal
        if frames:  # the newest joint_states before the images whose arrival steps
            drained.append(self._js_sub)
        if not timer and self._cams is not None:
            drained += self._cams.raw_subs()  # the compressed ones: the decode thread
        stepping = None if timer or frames else self._js_sub
        # observation mode: the thread that steps answers the services too (inputs.py)
        host = None if timer else self.service_host
        self._inputs = InputLoop(
            self.context,
            self.get_logger(),
            drained,
            stepping,
            host,
            after_drain=self._step_if_due if frames else None,
            acknowledge=None if timer or self._cams is None else self._cams.acknowledge,
            # observation trigger: inputs that stop make no step that could find them stale
            watch=None if timer or self._pub_traj is None else self._hold_when_stopped,
        )
        if not self.defer_inputs:
            self._start_inputs()
        self.get_logger().info(
            f"configured {policy.policy_id} on {engine.device} "
            f"({self._step_kind(engine)}), "
            f"state {engine.state_nbytes} B, {cfg.capsule_slots} capsule slots, "
            f"trigger {cfg.trigger}{' (busy wait)' if cfg.busy_wait else ''}"
            f"{' on ' + ' + '.join(cfg.step_on) if frames else ''}, "
            f"{len(engine.capsules())} capsules reloaded, "
            f"cameras: {', '.join(cfg.cameras) or 'none'}, "
            f"{time.monotonic() - t0:.2f} s"
        )
        self.startup["policy load"] = built.load_s
        self.startup.update({f"engine {k}": v for k, v in engine.build_s.items()})
        self.get_logger().info(
            "start-up: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in self.startup.items())
            + self._warmed_note(engine.device.type == "cuda")
            + f"; compile cache {engine.compile_cache or 'torch default'}"
            + ("" if engine.fuse else " (unused: nothing is compiled on the CPU or with fuse off)")
        )
        if not engine.fusing:  # else once the build ends
            self._log_precompiled(engine)
        # Everything built so far lives as long as the node: freezing it keeps the collector's
        # full passes (which hold the GIL for milliseconds) from walking it during control.
        # No collection first: it found a few dozen unreachable objects among ~200k and took
        # 87 ms on the 2-core CPU machine (ad hoc); cleanup unfreezes and collects them.
        gc.freeze()
        return super().on_configure(state)

    def _warn_unlocked(self) -> None:
        """capsule_dir's lock is held from configure to cleanup (capsules/folder_lock.py): a
        second node given the same folder fails its configure, naming this one, instead of
        reloading and deleting this node's capsules and flight dumps. Say when it could not be."""
        lock = self._dir_lock
        if lock is not None and not lock.held:
            self.get_logger().warning(
                f"capsule_dir {lock.folder} is used without its lock ({lock.why_unlocked}): "
                "nothing keeps a second node off it"
            )

    def _unlock_capsule_dir(self) -> None:
        lock, self._dir_lock = self._dir_lock, None
        if lock is not None:
            lock.release()

    def _warmed_note(self, cuda: bool) -> str:
        """What main.py's context warmer did, for the start-up log ("" when there was none, or
        on the CPU)."""
        w = self.context_warmer
        if w is None or not cuda:
            return ""
        if w.seconds is not None:
            return f"; CUDA context made beside the imports in {w.seconds:.2f} s"
        return f"; CUDA context not made ahead ({w.error or 'still being made'})"

    @staticmethod
    def _step_kind(engine: Engine) -> str:
        """How the step runs, for the configure log line."""
        if not engine.session("main").captured:
            return "eager CPU path"
        if engine.fused_mismatch:  # the Engine logged it as an error too
            return f"captured graph, unfused (the fused step differed: {engine.fused_mismatch})"
        if engine.fusing:
            return "captured graph, unfused until the fused step is built (late_fuse)"
        return "captured graph, " + ("fused" if engine.fuse else "unfused (fuse: false)")

    @staticmethod
    def _kernels(engine: Engine) -> str:
        """What the live step runs, for /diagnostics."""
        if engine.fusing:
            if not engine.fusing_begun:
                return "eager (fused step built once stepping: late_fuse)"
            return "eager (fused step building: late_fuse)"
        return "fused" if engine.fused else "eager"

    def _late_fuse_ended(self, engine: Engine) -> None:
        """Say what came of late fusing (its thread put the GIL's switch interval and the
        collector back itself: runtime/latefuse.build_window)."""
        self._fuse_unlogged = False
        if engine.fusing:
            self.get_logger().warning("late_fuse: the fused step was still building; left")
            return
        # how it ended (engine.late_fuse) is the Engine's own log line (node/logs.py forwards it)
        self._log_precompiled(engine)

    def _log_precompiled(self, engine: Engine) -> None:
        if engine.precompiled is not None:
            self.get_logger().info(
                f"precompiled steps in {engine.precompiled.folder}: "
                + "; ".join(engine.precompiled.events)
            )

    @_says_why
    def on_activate(self, state) -> TransitionCallbackReturn:
        with self._inputs.lock:  # between two messages of the inputs' loop
            with self._obs_lock:
                self._latest_obs = None  # never act on an observation from before activation
            if self.cfg.trigger == "timer" and self._js_sub is not None:
                while take(self._js_sub) is not None:  # nor on one queued while inactive
                    pass
            if self._cams is not None:  # nor on an image from before it; and frame steps
                self._cams.clear(then=self._reset_due)  # count only the frames after it
            else:
                self._reset_due()
            self.active = True
        if self.cfg.trigger == "observation" and self.cfg.busy_wait:
            self._inputs.set_busy(True)  # the thread that steps polls while active (busy_wait)
        if self.cfg.trigger == "timer":
            self._started_late = False  # a new loop's first tick is on time
            self._uncounted = False  # nor does it inherit a fault's copy (observation mode's)
            self._loop = TimerLoop(
                self.cfg.rate_hz,
                self._timer_tick,
                self._on_timing,
                self._on_tick_error,
                lock=self.control.lock,
                idle=self.diagnostics.idle,  # /diagnostics in the control thread's slack
                # the services are answered by the control thread between ticks (host.py)
                serving=self.service_host.lent,
                wake=self.service_host.wake,
                busy=self.cfg.busy_wait,
            )
            self.diagnostics.by_loop = True
            self._schedule(self._loop.start())
        self.get_logger().info(f"active: {self.cfg.trigger} trigger, live session {self.live!r}")
        return super().on_activate(state)

    @_says_why
    def on_deactivate(self, state) -> TransitionCallbackReturn:
        with self.control.lock:  # a step in flight finishes first; none starts after this
            self.active = False
        self._hold()  # after any output in flight (_out_lock), while the publishers still work
        self._inputs.set_busy(False)  # inactive: it sleeps until a message or request comes
        self._stop_loop()
        self.flight.on_stop("deactivate")
        self.get_logger().info("inactive: no more commands, the robot holds")
        return super().on_deactivate(state)

    @_says_why
    def on_cleanup(self, state) -> TransitionCallbackReturn:
        self._release()
        self.get_logger().info("cleaned up: engine and GPU memory freed")
        return super().on_cleanup(state)

    @_says_why
    def on_shutdown(self, state) -> TransitionCallbackReturn:
        self.control.finalized = True  # no transition leaves finalized: requests say so
        self._wind_down(dump=self.active)
        self.get_logger().info(
            "finalized (lifecycle shutdown): no more commands, the robot holds; restart the "
            "process to serve again"
        )
        return super().on_shutdown(state)

    def on_error(self, state) -> TransitionCallbackReturn:
        """A transition raised: rclpy then puts the node in unconfigured. Hold, stop and
        release what configure made (the engine, the capsule_dir lock), so that the next
        configure starts clean instead of finding its own lock held."""
        self.get_logger().error(
            f"a lifecycle transition from {state.label} raised (see above): the robot holds; "
            "engine and capsule_dir released, configure again to serve"
        )
        self._wind_down()
        return TransitionCallbackReturn.SUCCESS

    def _wind_down(self, dump: bool = False) -> None:
        """Stop commanding (the robot holds; the publishers still publish, after any output in
        flight), stop the loop, dump the flight recorder (`dump`: a shutdown from active, as a
        deactivate does), release the engine and the capsule_dir lock."""
        self.active = False
        self._hold()
        self._stop_loop()
        if dump:
            self.flight.on_stop("stop")
        self._release()

    def _stop_loop(self) -> None:
        if self._loop is not None:
            if not self._loop.stop():
                self.get_logger().warning(
                    "the control thread is still inside a tick after 5 s; it ends after it"
                )
            self._loop = None
        self.diagnostics.by_loop = False  # the executor's timer publishes them again

    def start_inputs(self) -> None:
        """Start the inputs' loop of a configured node, if it does not run yet."""
        if self._inputs is not None and not self._inputs.running:
            self._start_inputs()

    def _start_inputs(self) -> None:
        if self._cams is not None:
            self._cams.start_decoding()  # the compressed cameras' thread, if any
        thread = self._inputs.start()
        if self.cfg.trigger == "observation":  # its thread steps
            self._schedule(thread)

    def _schedule(self, thread) -> None:
        """The stepping thread on `cpu_affinity`'s CPUs and at `realtime_priority`."""
        self._pin(thread)
        self._realtime(thread)

    def _pin(self, thread) -> None:
        """The stepping thread kept on `cpu_affinity`'s CPUs ('': left as it is)."""
        text = self.cfg.cpu_affinity
        if not text or thread is None:
            return
        why = set_affinity(thread, params.parse_cpus(text))
        if why:
            self.get_logger().warning(
                f"cpu_affinity={text!r} not applied to {thread.name}: {why}; it runs on any CPU"
            )
        else:
            self.get_logger().info(f"{thread.name} runs on CPU {text}")

    def _realtime(self, thread) -> None:
        """The stepping thread at `realtime_priority` (0: left as it is)."""
        prio = self.cfg.realtime_priority
        if prio <= 0 or thread is None:
            return
        note = throttle_note(prio, self.cfg.busy_wait)
        if note:
            self.get_logger().warning(note)
        why = set_realtime(thread, prio)
        if why:
            self.get_logger().warning(
                f"realtime_priority={prio} not applied to {thread.name}: {why}; normal scheduling"
            )
        else:
            self.get_logger().info(f"{thread.name} runs at SCHED_FIFO priority {prio}")

    def stop_threads(self) -> None:
        """The control loop and the inputs' loop end (main.py, at exit): nothing steps after.
        A late-fusing build is cancelled and given a moment to end: it freezes the heap as it
        ends, which must come before main.py's last unfreeze and collection."""
        self._stop_loop()
        self._close_inputs()
        if self._stop_fusing(EXIT_FUSE_WAIT_S):
            self.get_logger().warning("late_fuse: the build was still running at exit")
        if self._stopped_active:  # a signal stopped it serving: the ring goes with the process
            # written before exit (FlightServices.close, atexit); a stuck step: no dump
            self.flight.on_stop("stop", wait_s=STOP_DUMP_WAIT_S)

    def _stop_fusing(self, timeout: float) -> bool:
        """Cancel a late-fusing build and wait up to `timeout` for it; True if it still runs."""
        eng = self.engine
        if eng is None or not eng.fusing:
            return False
        eng.cancel_fusing()
        eng.finish_fusing(timeout=timeout)
        return eng.fusing

    def _close_inputs(self) -> None:
        if self._cams is not None:
            self._cams.stop_decoding()
        if self._inputs is not None:
            self._inputs.close()
            self._inputs = None

    def _release(self) -> None:
        self._close_inputs()  # it ends before the subscriptions it waits on go
        for s in self._subs:
            self.destroy_subscription(s)
        self._subs, self._js_sub = [], None
        if self._cams is not None:
            self._cams.close(self)
            self._cams = None
        for p in (self._pub_cmd, self._pub_traj):
            if p is not None:
                self.destroy_lifecycle_publisher(p)
        self._pub_cmd = self._pub_traj = None
        with self.engine_lock:
            fused = self.engine is not None and self.engine.fuse
            # a build compiles with the old policy: stop it, wait for it
            building = self._stop_fusing(FUSE_WAIT_S)
            if self._fuse_unlogged:
                self._late_fuse_ended(self.engine)
            if self.engine is not None:  # the next engine's ids start after this one's
                self._ids_from = max(self._ids_from, self.engine.pool.next_number())
            self.engine = None
        if building:  # resetting dynamo under a compile in flight is not safe: leave it
            self.get_logger().warning(
                f"late_fuse: the build thread did not end in {FUSE_WAIT_S:g} s; compiled code "
                "of the old policy stays in memory"
            )
        elif fused:  # drop compiled code that holds the old policy's weights
            torch._dynamo.reset()
        self.flight.release()  # its reference to the engine, too
        gc.unfreeze()  # what configure (and a build) froze may be garbage now: collect it,
        gc.collect()  # old engine and compiled code included, before the cache is emptied
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if not self.flight.flush():
            self.get_logger().warning(
                "flight recorder: a dump was still being written 30 s into the cleanup; "
                "capsule_dir's lock goes now"
            )
        self._unlock_capsule_dir()  # after the flight dumps' writes and the engine

    # -- inputs ------------------------------------------------------------------------------------
    def _refuse(self, why: str, stepping: bool = False) -> None:
        """Count and (throttled) log a refused input. `stepping`: the observation trigger's
        joint_states itself was refused, which /diagnostics then names over the wait for one."""
        if stepping:
            self._js_refused_at = time.monotonic()
        with self.stats.lock:
            self.stats.refused += 1
            self.stats.last_refusal = why
        # throttled here, before the logger: rclpy's own throttle comes after its caller
        # lookup (~0.3 ms on the CPU machine), which a stream of refused messages (a gripper
        # driver sharing joint_states) paid inside every tick
        now = time.monotonic()
        if now - self._refusal_logged_at >= 2.0:
            self._refusal_logged_at = now
            self.control.fast_log.warning(f"refused input: {why}")

    def _take_newest_joint_states(self, sub) -> None:
        """Timer mode, at the top of a tick: every queued joint_states taken serialized, and
        only the newest valid one made a message (newest first, until one is valid). The ones
        before it are superseded unexamined and only counted in the input rate: converting and
        checking a backlog after a stall, message by message, took 300-450 us of the very tick
        that woke late (the inputs part of every 1 kHz overrun's account on one H100); 5 queued
        messages cost 271 us that way on the 2-core CPU machine, ad hoc."""
        backlog = []
        while (got := take(sub)) is not None:
            backlog.append(got)
        while backlog:
            raw, age = backlog.pop()
            if self._on_joint_states(deserialize_message(raw, JointState), age=age):
                break
        if backlog:
            now = time.monotonic()
            with self.stats.lock:
                for _raw, age in backlog:
                    self.stats.js_times.add(now - age)

    def _on_joint_states(self, msg: JointState, age: float = 0.0) -> bool:
        """One joint_states: refused (False) or taken as the newest observation (True)."""
        if self.mapper is None:
            return False
        try:
            obs = self.mapper.observation(msg.name, msg.position, msg.velocity, msg.effort)
        except ValueError as e:
            self._refuse(str(e), stepping=self._per_message)
            return False
        if self.cfg.flight_ticks:  # the stamps the recorder keeps for ~/rewind by time
            self.flight.seen(msg.header.stamp)
        if self._per_message:
            self._js_at = received = time.monotonic() - age
            if self.active:  # its age checked too: after a stall, a backlog is not stepped on
                self._step(obs, received)
            with self.stats.lock:  # the input's rate (joint_states_hz), after the step
                self.stats.js_times.add(received)
            return True
        with self._obs_lock:
            self._latest_obs, self._latest_t = obs, time.monotonic() - age
            self._js_taken += 1
        with self.stats.lock:
            self.stats.js_times.add(self._latest_t)
        return True

    def _reset_due(self) -> None:
        """Frame steps: only the messages from now on make the next step."""
        with self._due_lock:
            self._stepped_at = self._input_counts()
            self._frame_at = 0.0  # the time inactive is no stale time

    def _input_counts(self) -> tuple[int, ...]:
        """Frame steps: the valid messages of each step_on input so far."""
        if not self._frames:
            return ()
        return tuple(
            self._js_taken if name == "joint_states" else self._cams.accepted(name)
            for name in self.cfg.step_on
        )

    def _step_if_due(self) -> None:
        """Frame steps (step_on): one step once every listed input has a new valid message since
        the last one, on the newest of every input. Called by the inputs' thread once it has
        taken what it found (a backlog steps once), and by a decode thread after each frame:
        the check and its reset are one, under _due_lock."""
        if not self.active:
            return
        with self._due_lock:
            counts = self._input_counts()
            if any(n <= was for n, was in zip(counts, self._stepped_at, strict=True)):
                return
            self._stepped_at = counts
            now = time.monotonic()
            self._frame_gap = now - self._frame_at if self._frame_at else 0.0
            self._frame_at = now
        with self._obs_lock:
            obs, t = self._latest_obs, self._latest_t
        self._step(obs, t)  # stale joint_states or cameras: no step, counted as a stale tick

    def _on_goal(self, msg: Float64MultiArray, age: float = 0.0) -> None:
        with self.engine_lock:
            if self.engine is None:
                return
            try:
                self.engine.set_goal(msg.data, session=self.live)
                change = self._goal_echo.changed()
            except ValueError as e:  # the engine's reasons already name the goal
                self._refuse(str(e) if str(e).startswith("goal") else f"goal: {e}")
                return
            except Exception as e:  # a device error is no bad goal: the fault path
                self.control.fault("goal", e)
                return
        self._goal_echo.say(change, msg.data)
        line = f"goal applied: {np.round(msg.data, 3).tolist()}"
        more = self._goal_lines.due(line=line)
        if more is not None:
            self.control.fast_log.info(line + more)

    def _on_moved(self, eng: Engine, session: str) -> None:
        """A request put the session's state elsewhere (engine lock held): the flight recorder
        forgets the stamps past it, and the live session's goal is echoed again, once the
        replies are sent (goal_echo.py)."""
        self.flight.forget(eng, session)
        if session == self.control.live:
            self._goal_echo.moved()

    def _after_replies(self) -> None:
        """The serving thread, once the replies of a wake-up are sent: the goal echo a request
        made due, then the lines the requests said."""
        try:
            self._goal_echo.flush(self.control)
        finally:
            self.control.write_said()

    # -- stepping ----------------------------------------------------------------------------------
    def _timer_tick(self, deadline: float) -> None:
        t_in = time.monotonic()
        self._tick_usage.mark()  # for last_overrun, if this tick overruns
        if self._cams is not None:
            self._cams.take()  # the control thread takes the images itself too
        if self._js_sub is not None:
            self._take_newest_joint_states(self._js_sub)
        with self._obs_lock:
            obs, t = self._latest_obs, self._latest_t
        offset = self.cfg.publish_offset_s
        at = deadline + offset if offset > 0 else None
        self._step(obs, t, publish_at=at, tick_start=t_in)

    def _prestage(self, key: str, img: np.ndarray) -> bool:
        """Observation mode: stage a valid image as it arrives (on the inputs' thread, which
        steps, or on the decode thread for a compressed camera; under the engine lock, so between
        two steps), so the step on the next joint_states does not copy it (Engine.prestage; on
        CUDA only). Anything that goes wrong here only means the step stages it itself."""
        ctl, t0 = self.control, time.perf_counter()
        with ctl.lock:
            if (cams := self._cams) is not None:
                cams.prestage_lock_us.add((time.perf_counter() - t0) * 1e6)
            eng = ctl.engine
            if eng is None or not self.active:
                return False
            try:
                return eng.prestage(key, img, session=ctl.live)
            except Exception as e:  # noqa: BLE001 - a poisoned session, a device error: the step says
                self.get_logger().debug(f"prestage of {key!r} skipped: {e}")
                return False

    def _unheard_publishers(self) -> list[str]:
        """A reliable subscription never matches a BEST_EFFORT publisher (many camera
        drivers), and nothing else says so: observation mode subscribes reliably (lockstep
        must lose nothing), and the goal is reliable in both modes. Each such publisher is
        logged once."""
        cfg = self.cfg
        if cfg is None:
            return []
        subs = list(self._subs) + ([c.sub for c in self._cams.cams] if self._cams else [])
        try:
            lines = unmatched(self, subs)
        except Exception as e:  # noqa: BLE001 - the graph is gone (shutting down)
            self.get_logger().debug(f"QoS check skipped: {e}")
            return []
        for line in lines:
            if line not in self._unheard_logged:
                self._unheard_logged.add(line)
                timer = (
                    " or use trigger:=timer, which takes both," if not self._is_goal(line) else ""
                )
                self.get_logger().warning(
                    f"{line}: its messages never arrive (the subscription is reliable; make the "
                    f"publisher reliable,{timer} or set the read-only parameter "
                    f"qos_overrides.{line.split(':', 1)[0]}.subscription.reliability to "
                    "best_effort)"
                )
        return lines

    def _is_goal(self, line: str) -> bool:
        return line.split(":", 1)[0] == self._subs[0].topic_name

    def _waiting_for(self, now: float) -> str:
        """What a step waits for, in words ("" when nothing): with frame steps (step_on), the
        first listed input with no valid message newer than obs_timeout_s; with the observation
        trigger, joint_states. Inputs that stop make no tick, so no stale tick says so."""
        if self.cfg is None or not (self._frames or self._per_message):
            return ""
        for name in self.cfg.step_on if self._frames else ("joint_states",):
            if name == "joint_states" and self._per_message:
                age = now - self._js_at if self._js_at else None
                what = "joint_states"
            elif name == "joint_states":
                with self._obs_lock:
                    age = None if self._latest_obs is None else now - self._latest_t
                what = "joint_states"
            else:
                age = self._cams.age(name, now) if self._cams is not None else None
                what = f"camera {name}"
            if age is None:
                return f"{what} (none valid yet)"
            if age > self.cfg.obs_timeout_s:
                return f"{what} (none valid for {age:.1f} s)"
        return ""

    def _stale(self, why: str) -> None:
        """A step not taken for stale inputs; stale_s adds the time it stood for: a period of
        the timer, or, for frame steps, the time since the frame set before."""
        self._stale_why, self._stale_at = why, time.monotonic()
        with self.stats.lock:
            self.stats.stale_ticks += 1
            self.stats.stale_s += self._loop.period if self._loop else self._frame_gap

    def _step(
        self,
        obs: np.ndarray | None,
        received: float | None = None,
        publish_at: float | None = None,
        tick_start: float | None = None,
    ) -> None:
        """One tick. In timer mode `received` is when obs arrived: its age is checked after
        the engine lock is taken, so a request that held the lock cannot make us step on
        stale data. With `publish_at` the outputs wait (spinning) for that monotonic time.
        The tick's times (from `tick_start`, before the inputs were taken) are marked between
        its parts (TICK_PARTS), for `last_overrun` when it overran."""
        t0 = time.monotonic()
        ctl = self.control
        marks = self._marks
        marks[0], marks[1] = t0 if tick_start is None else tick_start, t0
        self._marked, self._offset = 2, publish_at is not None
        with ctl.lock:
            marks[2] = time.monotonic()
            self._marked = 3
            eng = ctl.engine
            if eng is None or not self.active:  # re-checked under the lock: deactivate holds it
                return
            age = 0.0 if received is None else time.monotonic() - received
            if received is not None and (obs is None or age > self.cfg.obs_timeout_s):
                self._hold()
                if self._per_message:  # one step per joint_states: this one is refused
                    self._refuse(
                        f"stale: joint_states received {age:.3f} s ago, older than "
                        f"obs_timeout_s={self.cfg.obs_timeout_s:g} (not stepped on)",
                        stepping=True,
                    )
                    return
                self._stale("joint_states")
                if self._cams is not None:  # counted on the stale cameras too
                    self._cams.stale(time.monotonic(), self.cfg.obs_timeout_s)
                return  # stale: no step, no command; the robot holds
            x = obs
            if self._cams is not None:  # each camera has its own staleness
                cam = self._cams.stale(time.monotonic(), self.cfg.obs_timeout_s)
                if cam:
                    self._hold()
                    if not self._per_message:
                        self._stale(f"camera {cam}")
                    else:  # observation trigger: this joint_states is refused
                        why = self._cams.refused_since(cam)  # the cause, when images are refused
                        self._refuse(
                            f"stale: camera {cam!r} has no valid image newer than "
                            f"obs_timeout_s={self.cfg.obs_timeout_s:g}"
                            + (f" (its images are refused: {why})" if why else ""),
                            stepping=True,
                        )
                    return
                x = self._cams.observation(obs, self._state_key)
            live = ctl.live
            if eng.poisoned(live):
                self._hold()
                return  # nothing for a poisoned session; /diagnostics reports it each second
            try:
                if self._pub_traj is not None:
                    action, chunk = eng.step_with_chunk(x, session=live)
                else:
                    action, chunk = eng.step(x, session=live), None
            except ValueError as e:
                self._refuse(str(e), stepping=self._per_message)
                self._forget(obs)
                return
            except Exception as e:  # StepFault (the session is poisoned now), a device error
                self._hold()
                ctl.fault(f"step of {live!r}", e, step_error=True)
                self.flight.on_step_error(eng, live)  # the ring's copy: not an overrun
                self._uncounted = True
                return
            self.flight.tick(eng, live)
        marks[3] = time.monotonic()
        self._marked = 4
        if not np.isfinite(action).all() or (chunk is not None and not np.isfinite(chunk).all()):
            self._hold()
            ctl.fault(f"step of {live!r}: non-finite output, not published", step_error=True)
            return  # the engine raises first; this check makes sure of it at the publisher
        dt = time.monotonic() - t0
        if publish_at is not None:  # sleep (the GIL free for other threads), spin the last bit
            if self.cfg.busy_wait:  # never sleep (busy_wait): yield the CPU, keep the core
                while publish_at - SPIN_S > time.monotonic():
                    os.sched_yield()
            elif (early := publish_at - SPIN_S - time.monotonic()) > 0:
                time.sleep(early)
            while time.monotonic() < publish_at:
                pass
        marks[4] = time.monotonic()
        if received is not None and (age := marks[4] - received) > self.cfg.obs_timeout_s:
            # a step that ran long (a hung device, a stall): its command is as old as its
            # observation, which is now stale; a 3 s step published a 3 s old command (review)
            self._hold()
            took = marks[3] - marks[2]
            why = (  # a long step, or an observation already near its timeout (a stream that
                # stopped just before the tick: no slow step to look for)
                f"late: the step took {took * 1e3:.0f} ms, so its joint_states were"
                if took > 0.5 * self.cfg.obs_timeout_s
                else f"stale at publish (the step took {took * 1e3:.0f} ms): its joint_states were"
            )
            self._refuse(
                f"{why} {age:.3f} s old at publish, older than obs_timeout_s="
                f"{self.cfg.obs_timeout_s:g}: not published, the robot holds",
                stepping=self._per_message,
            )
            return
        with self._out_lock:  # deactivated since the step (its hold sent): nothing goes out
            if not self.active:
                return
            if self._pub_cmd is not None:  # first: the command waits for no trajectory
                self._pub_cmd.publish(command_msg(action))
            if chunk is not None:
                stamp = self.get_clock().now().to_msg()
                self._pub_traj.publish(
                    trajectory_msg(chunk, self.cfg.joint_names, 1.0 / self.cfg.rate_hz, stamp)
                )
                self._traj_running, self._traj_at = True, time.monotonic()
        if self.process_t0 is not None:  # the first command of the process: say when
            t, self.process_t0 = self.process_t0, None
            self.get_logger().info(f"first command {time.monotonic() - t:.2f} s after start")
        marks[5] = time.monotonic()
        self._marked = 6
        with self.stats.lock:
            self.stats.steps += 1
            self.stats.step_us.add(dt * 1e6)
            self.stats.tick_times.add(t0)

    def _hold(self) -> None:
        """The robot holds, with joint_trajectory output too: a joint_trajectory_controller
        runs the last trajectory it got to its end (a whole chunk, up to seconds ahead) unless
        an empty one (the joint names, no points) cancels it, which is what this sends, once
        per stop (stale inputs, a fault, deactivate). Plain commands need nothing: no command
        is the hold."""
        with self._out_lock:
            if self._traj_running and self._pub_traj is not None:
                self._traj_running = False
                self._pub_traj.publish(JointTrajectory(joint_names=list(self.cfg.joint_names)))

    def _same_name_nodes(self) -> int:
        """How many nodes on the graph have this node's name and namespace (1: only this one).
        ROS allows twins and says nothing; each publishes commands, and a monitor of
        /diagnostics sees one entry. A graph cache lookup (~1 us), logged when it rises."""
        me = (self.get_name(), self.get_namespace())
        try:
            n = sum(1 for node in self.get_node_names_and_namespaces() if node == me)
        except Exception:  # noqa: BLE001 - the context is going away: nothing to say
            return 0
        if n > self._twins_said:
            self.control.fast_log.warning(
                f"{n} nodes named {self.get_fully_qualified_name()} on the graph: two policies "
                "may be commanding one controller; give each its own namespace"
            )
        self._twins_said = n
        return n

    def hold_for_exit(self) -> None:
        """Ctrl-C or SIGTERM (signals.py), while the publishers still publish: no step's output
        goes out after this, and a running trajectory is held. Not under the engine lock: a
        step stuck on the device must not keep the robot moving."""
        with self._out_lock:
            was = self.active
            self.active = False
            self._hold()
        if was:
            self._stopped_active = True  # stop_threads() dumps the flight recorder
            self.get_logger().info("stopping (signal): no more commands, the robot holds")

    def _hold_when_stopped(self) -> float | None:
        """Observation trigger (InputLoop.watch): inputs that stop make no step, so no step
        finds them stale; the trajectory is held once none went out for obs_timeout_s. Seconds
        until the next look, None when nothing runs."""
        if not self._traj_running:
            return None
        left = self._traj_at + self.cfg.obs_timeout_s - time.monotonic()
        if left > 0:
            return left
        self._hold()
        return None

    def _forget(self, obs: np.ndarray | None) -> None:
        """A refused observation is not stepped on again at the next tick."""
        with self._obs_lock:
            if self._latest_obs is obs:
                self._latest_obs = None

    def _served(self, service: str, queued_s: float | None, reply_s: float | None) -> None:
        """All services' and each one's (/diagnostics: service_<name>_queue_p50_us and
        service_<name>_reply_p50_us beside the handler's service_<name>_p50_us)."""
        st = self.stats
        with st.lock:
            if queued_s is not None:
                st.service_queue_us.add(queued_s * 1e6)
                st.service_ring(f"{service}_queue").add(queued_s * 1e6)
            if reply_s is not None:
                st.service_reply_us.add(reply_s * 1e6)
                st.service_ring(f"{service}_reply").add(reply_s * 1e6)

    def _on_tick_error(self, e: Exception) -> None:
        if not self.context.ok():  # shutting down (Ctrl-C): the loop is about to stop
            return
        self.control.fault("control tick", e, step_error=True)

    def _on_timing(self, jitter: float, missed: int, took: float, delayed: bool = False) -> None:
        # a tick the one before delayed did not wake late: its lateness is that tick's run
        inherited, self._started_late = self._started_late, delayed
        if self._uncounted:  # the faulted tick copied the flight ring: nothing was due
            self._uncounted = missed = 0  # (the session is poisoned; the log gave the time)
        with self.stats.lock:
            self.stats.jitter_us.add(abs(jitter) * 1e6)
            self.stats.delayed_ticks += delayed
            if missed:
                self.stats.overruns += missed
                self.diagnostics.behind = True  # publish on time, slack or not (diagnostics.py)
                if jitter > took and not inherited:
                    self.stats.overruns_late_wake += 1
                else:
                    self.stats.overruns_long_tick += 1
                if self._tick_usage.collector_passes():  # in any thread, during the tick
                    self.stats.overruns_collector += 1
                m = self._marks
                split = ", ".join(
                    f"{part} {(m[i + 1] - m[i]) * 1e6:.0f}"
                    for i, part in enumerate(TICK_PARTS[: self._marked - 1])
                    if part != "offset" or self._offset
                )
                usage = self._tick_usage.since()
                late = "started" if inherited else "woke"
                self.stats.last_overrun = (
                    f"{late} {jitter * 1e6:.0f} us late"
                    + (" (the tick before ran into its period)" if inherited else "")
                    + f", tick took {took * 1e6:.0f} us"
                    + (f" ({split} us)" if split else "")
                    + f", {missed} tick(s) skipped"
                    + (f"; the tick's thread: {usage}" if usage else "")
                )

    # -- diagnostics -------------------------------------------------------------------------------
    def _state_name(self) -> str:
        if self.active:
            return "active"
        if self.engine is not None:
            return "inactive"
        return "finalized" if self.control.finalized else "unconfigured"

    def diagnostic_array(self, engine_wait_s: float | None = None) -> DiagnosticArray:
        """This node's /diagnostics message now (published by diagnostics.Diagnostics); it
        waits up to `engine_wait_s` (default ENGINE_WAIT_S) for the engine, then says busy."""
        sn = self.stats.snapshot(time.monotonic())  # percentiles computed off the stats lock
        rate = sn["rate_hz"]
        kv = {
            "state": self._state_name(),
            "rate_hz": f"{rate:.1f}",
            # valid joint_states a second: below rate_hz, timer ticks step on repeats
            "joint_states_hz": f"{sn['joint_states_hz']:.1f}",
            "steps": str(sn["steps"]),
            "step_p50_us": f"{sn['step_p50_us']:.1f}",
            "step_p99_us": f"{sn['step_p99_us']:.1f}",
            "jitter_p99_us": f"{sn['jitter_p99_us']:.1f}",
            "overruns": str(sn["overruns"]),
            "last_overrun": sn["last_overrun"],
            "overruns_late_wake": str(sn["overruns_late_wake"]),
            "overruns_long_tick": str(sn["overruns_long_tick"]),
            "overruns_collector": str(sn["overruns_collector"]),
            "delayed_ticks": str(sn["delayed_ticks"]),
            "refused_inputs": str(sn["refused"]),
            "last_refusal": sn["last_refusal"],
            "stale_ticks": str(sn["stale_ticks"]),
            "stale_s": f"{sn['stale_s']:.2f}",
            "service_p50_us": f"{sn['service_p50_us']:.1f}",
            "service_p99_us": f"{sn['service_p99_us']:.1f}",
            "service_lock_wait_p50_us": f"{sn['lock_wait_p50_us']:.1f}",
            "service_lock_wait_p99_us": f"{sn['lock_wait_p99_us']:.1f}",
            "service_queue_p50_us": f"{sn['service_queue_p50_us']:.1f}",
            "service_queue_p99_us": f"{sn['service_queue_p99_us']:.1f}",
            "service_reply_p50_us": f"{sn['service_reply_p50_us']:.1f}",
            **{f"service_{k}_p50_us": f"{v:.1f}" for k, v in sn["service_by_p50_us"].items()},
            "step_errors": str(sn["step_errors"]),
            "last_error": sn["last_error"],
            "faults": str(sn["faults"]),
            "last_fault": sn["last_fault"],
        }
        new_faults = sn["new_faults"]
        if sn["refused"] != self._refused_seen:  # refusals since the last status
            self._refused_seen, self._refused_at = sn["refused"], time.monotonic()
        refusing = time.monotonic() - self._refused_at < 2.0  # rate_hz's window
        if (goal_line := self._goal_lines.overdue()) is not None:  # a goal stream's last
            self.control.fast_log.info(goal_line)
        ctl, poisoned, live, busy_s = self.control, {}, "", 0.0
        wait = self.ENGINE_WAIT_S if engine_wait_s is None else engine_wait_s
        with ctl.lock.within(wait) as held:
            eng = ctl.engine if held else None
            if not held:  # a step or request stuck in the engine: say so, and go on
                busy_s = max(time.monotonic() - ctl.lock.held_since, 0.0)  # inf: just freed
                kv["engine_busy_s"] = f"{busy_s:.2f}"
            if eng is not None:
                live, sessions = ctl.live, eng.sessions()
                poisoned = {s: why for s in sessions if (why := eng.poisoned(s))}
                # capsules lost: evicted from a full pool, files not loaded at start
                kv["capsules_evicted"] = str(eng.evicted_total)
                lost = eng.store.still_not_loaded()
                kv["capsule_files_not_loaded"] = str(len(lost))
                kv["last_not_loaded"] = f"{lost[-1].path}: {lost[-1].reason}" if lost else ""
                kv["live_session"] = live
                kv["sessions"] = ",".join(sessions)
                kv["capsules"] = str(len(eng.capsules()))
                kv["pool_bytes_used"], kv["pool_bytes_total"] = map(str, pool_bytes(eng))
                kv["device"] = str(eng.device)
                # what the inputs take (flashrt-replay reads goal_dim: a goal of another size is
                # refused, and no ~/goal_applied echo comes for it)
                kv["policy"] = str(eng.policy.policy_id)
                kv["obs_dim"], kv["goal_dim"] = str(eng.obs_dim), str(eng.goal_dim)
                kv["action_dim"] = str(eng.action_dim)
                if eng.fusing:  # a commit boundary: a fused step built by now is swapped in
                    eng.finish_fusing(timeout=0)
                if self._fuse_unlogged and not eng.fusing:  # swapped here or at a tick
                    self._late_fuse_ended(eng)
                kv["kernels"] = self._kernels(eng)
                kv["late_fuse"] = eng.late_fuse  # what came of it ("" before, or without)
                kv.update(self.flight.diagnostics(eng, live))
        kv["disk_write_failures"] = str(ctl.disk_failures)
        kv["last_disk_error"] = ctl.disk_error
        # timer mode: the latest tick held on stale inputs (no step since): stale now, not only
        # once no step came for rate_hz's 2 s window
        now = time.monotonic()
        holding = self.cfg is not None and self.cfg.trigger == "timer"
        holding = holding and self.active and self._stale_at > sn["last_step_at"]
        quiet = rate == 0.0 or holding  # nothing steps now
        kv["stale_stream"] = self._stale_why if quiet and sn["stale_ticks"] else ""
        # the loop skipped periods within rate_hz's window: it cannot hold rate_hz
        # (more than a stray one: at least 2, and 1 % of the periods since the last status)
        skipped, self._overruns_seen = sn["overruns"] - self._overruns_seen, sn["overruns"]
        periods = (now - self._overruns_checked) * (self.cfg.rate_hz if self.cfg else 0.0)
        self._overruns_checked = now
        if skipped >= max(2, 0.01 * periods):
            self._overrun_at = now
        overrunning = self.active and now - self._overrun_at < 2.0
        if self.cfg is not None and self.cfg.trigger == "timer":
            kv["rate_hz_set"] = f"{self.cfg.rate_hz:.1f}"
        unheard = self._unheard_publishers()
        kv["qos_mismatch"] = "; ".join(unheard)
        twins = self._same_name_nodes()
        kv["same_name_nodes"] = str(twins)
        kv["services_thread"] = self.service_host.serving_thread
        # whether the thread that steps polls now (busy_wait, while active): a core at 100 %
        busy = self.active and self.cfg is not None and self.cfg.busy_wait
        kv["busy_wait"] = "polling" if busy else "off"
        # the node's own view of its matches ("-": not configured): commands that go to no
        # reader, or joint_states from no writer, say so here; and a client can tell when the
        # node, not only itself, has matched it (each side discovers the other on its own)
        pub, sub = self._pub_cmd, self._js_sub
        try:
            kv["command_subscribers"] = "-" if pub is None else str(pub.get_subscription_count())
            kv["joint_states_publishers"] = "-" if sub is None else str(sub.get_publisher_count())
        except Exception:  # noqa: BLE001 - a cleanup or shutdown took them meanwhile
            kv["command_subscribers"] = kv["joint_states_publishers"] = "?"
        cams = self._cams
        if cams is not None:
            kv.update(cams.diagnostics(time.monotonic()))
        shown = live if live in poisoned else next(iter(poisoned), "")
        kv["poisoned_session"] = shown
        kv["poisoned_reason"] = poisoned.get(shown, "")
        kv["poisoned_sessions"] = ",".join(poisoned)
        level, message = DiagnosticStatus.OK, "stepping"
        # what holds the robot: a stale stream, an input of step_on that stopped, refusals
        refused = f"inputs refused ({sn['last_refusal']})" if refusing else ""
        # (observation trigger: while its joint_states themselves are refused, the refusal
        # says why; a refused goal or image stops no step)
        js_refused = self._per_message and time.monotonic() - self._js_refused_at < 2.0
        waiting = ""
        if self.active and quiet and not js_refused:
            waiting = self._waiting_for(now)
        if waiting:  # what holds now, over the last stale tick's stream
            kv["stale_stream"] = waiting.split(" (", 1)[0]
        if busy_s:
            level = DiagnosticStatus.ERROR if busy_s >= 1.0 else DiagnosticStatus.WARN
            message = (
                f"engine busy for {busy_s:.1f} s (a step or a request holds it); its fields "
                "are left out of this status"
            )
        elif live in poisoned:
            level = DiagnosticStatus.ERROR
            message = (
                f"session {live!r} is poisoned ({poisoned[live]}): nothing is published; "
                "recover with ~/reset_session, ~/restore or ~/branch"
                + (" or ~/rewind" if self.cfg.flight_ticks else "")
            )
            more = self._poison_lines.due(message)  # a new reason at once, else once a minute
            if more is not None:
                self.control.fast_log.error(message + more)
        elif new_faults:
            level, message = DiagnosticStatus.ERROR, f"{new_faults} fault(s): {kv['last_fault']}"
        elif self.control.finalized:
            level = DiagnosticStatus.WARN
            message = "finalized (lifecycle shutdown): restart the process to serve again"
        elif not self.active:
            level, message = DiagnosticStatus.WARN, kv["state"]
        elif twins > 1:
            level = DiagnosticStatus.WARN
            message = (
                f"{twins} nodes named {self.get_fully_qualified_name()} on the graph: two "
                "policies may be commanding one controller (a namespace:= forgotten?), unless "
                "one stopped a moment ago and discovery has not forgotten it yet"
            )
        elif (
            # frame steps come only with frames: a stale tick of long ago says nothing now
            (
                self.cfg.trigger == "timer"
                or (self._frames and time.monotonic() - self._stale_at < 2.0)
            )
            and sn["stale_ticks"]
            and quiet
        ):
            level = DiagnosticStatus.WARN
            message = f"stale: no fresh {self._stale_why or 'joint_states'}, holding"
            if refused:  # the stream may be stale because its messages are refused
                message += f"; {refused}"
        elif unheard and (waiting or (refused and rate == 0.0)):  # nothing steps: likely why
            level = DiagnosticStatus.WARN
            message = f"a publisher is never heard: {unheard[0]}; no step: " + (
                f"waiting for {waiting}, holding" if waiting else refused
            )
        elif waiting:  # the input that steps stopped (or one of step_on, the others come)
            level = DiagnosticStatus.WARN
            message = f"no step: waiting for {waiting}, holding"
            if refused:
                message += f"; {refused}"
        elif refused and rate == 0.0:  # inputs come, and are all refused: nothing steps
            level = DiagnosticStatus.WARN
            message = f"no step: {refused}"
        elif overrunning:  # it steps, but not every period: the step or the machine is too slow
            level = DiagnosticStatus.WARN
            message = (
                f"overrunning: {rate:.0f} of rate_hz {self.cfg.rate_hz:g} ticks a second, "
                f"{sn['overruns']} periods skipped so far (last_overrun says why)"
            )
            if now - self._overload_logged_at >= 10.0:
                self._overload_logged_at = now
                self.control.fast_log.warning(f"{message}: {sn['last_overrun']}")
        elif poisoned:
            level, message = DiagnosticStatus.WARN, f"session {shown!r} is poisoned"
        elif unheard:
            level, message = DiagnosticStatus.WARN, f"a publisher is never heard: {unheard[0]}"
        elif ctl.disk_failing:  # the latest write to capsule_dir failed (full, read-only)
            level = DiagnosticStatus.WARN
            message = f"writes to capsule_dir fail: {ctl.disk_error}"
        elif refused:  # it steps, but inputs (goals, images) were refused in the last 2 s
            level, message = DiagnosticStatus.WARN, f"stepping; {refused}"
        if live not in poisoned and eng is not None:  # recovered: a new poison is written at once
            self._poison_lines.reset()
        status = DiagnosticStatus(
            level=level,
            name=f"{self.get_fully_qualified_name()}: control loop",
            message=message,
            hardware_id="flashrt",
            values=[KeyValue(key=k, value=v) for k, v in kv.items()],
        )
        arr = DiagnosticArray(status=[status])
        arr.header.stamp = self.get_clock().now().to_msg()
        return arr
