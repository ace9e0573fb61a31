"""flashrt_node: `ros2 run flashrt_ros flashrt_node [--ros-args ...]`.

Exit status: 0 after Ctrl-C (SIGINT or SIGTERM), 2 on a bad parameter (each named, with what
it accepts) or a failed autostart configure. A lifecycle shutdown leaves the node finalized and
the process running, as ROS lifecycle nodes do, until it is stopped.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import sys
import time
from collections.abc import Sequence

USAGE = """usage: flashrt_node [--ros-args -p NAME:=VALUE ... --params-file FILE]

Serves a stateful robot policy as a captured CUDA graph (ROS 2 LifecycleNode 'flashrt').
Subscribes joint_states and goal; publishes commands and/or joint_trajectory, and /diagnostics.
A bad parameter makes it exit with status 2, naming the parameter and what it accepts.
"""

# the private services (srv/*.srv), as `~/name` relative to the node
SERVICES = [
    ("checkpoint", "freeze a session (default: the live one) into a capsule"),
    ("restore", "bring a capsule (id or name) back into a session"),
    ("branch", "fork a capsule into a new or existing session, optionally with a new goal"),
    ("list_capsules", "the pool's capsules, the sessions, the live session and bytes"),
    ("drop_capsule", "drop a capsule"),
    ("drop_session", "drop a branch session (never main or the live one)"),
    ("rollout", "what-if: step a session or a scratch fork on given observations"),
    ("reset_session", "put a session back to its initial state (recovers a poisoned one)"),
    ("rewind", "back to one of the last flight_ticks ticks (needs flight_ticks > 0)"),
    ("dump_flight", "write a session's flight recorder ring into capsule_dir"),
]


def usage() -> str:
    """The --help text: the services and every parameter, from the parameter table."""
    from flashrt_ros.node.params import NODE_PARAMS

    services = "\n".join(f"  ~/{name:<15} {text}" for name, text in SERVICES)
    return (
        f"{USAGE}\nServices:\n{services}\n\n"
        f"Parameters (defaults in config/flashrt.yaml):\n{NODE_PARAMS.help_text()}\n"
    )


def _check_parameters(argv: Sequence[str]):
    """The node's config, or ParamError for bad parameters, found on a throwaway node of the
    same name (so the same remaps and params-file sections apply) before torch is imported."""
    import rclpy

    from flashrt_ros.node.params import NODE_PARAMS, ParamError

    try:
        probe = rclpy.create_node("flashrt", enable_rosout=False, start_parameter_services=False)
    except Exception as e:  # rcl refuses the name or namespace a remap gives (RCLError)
        raise ParamError([f"the node cannot be made: {e}"]) from None
    try:
        cfg = NODE_PARAMS.check(probe, argv)
    except ParamError as e:  # logged under the node's own name: which of two arms failed
        e.logger = probe.get_logger().name
        raise
    finally:
        probe.destroy_node()
    return cfg


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0.0 elsewhere), so the start-up log
    counts the interpreter's own start too."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def main(args: Sequence[str] | None = None) -> int:
    from flashrt_ros.node.signals import Interrupts

    interrupts = Interrupts()
    try:
        return _main(args, interrupts)
    except KeyboardInterrupt:  # a signal before rclpy took over (the first imports): done
        return stopped_early()
    except ImportError:
        # a Ctrl-C inside an extension's initialisation (rclpy's pybind11 module) comes out as
        # that module's ImportError ("initialization failed"), not as the KeyboardInterrupt
        if interrupts.signalled:
            return stopped_early()
        raise


def stopped_early() -> int:
    """A signal ended the start before the node served: say so (a launch's log otherwise ends
    with nothing from the node), and exit 0 as for any Ctrl-C."""
    with contextlib.suppress(OSError):  # stderr gone (a closed pipe): nothing to tell
        print("flashrt_node: stopped by a signal during start-up, before serving", file=sys.stderr)
    return 0


def _main(args: Sequence[str] | None, interrupts) -> int:
    argv = list(sys.argv if args is None else args)
    from flashrt_ros.node.params import wants_help

    if wants_help(argv):
        try:
            print(usage(), flush=True)
        except BrokenPipeError:  # `flashrt_node --help | head`: the reader had enough
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    t_start = time.monotonic() - process_age_s()
    try:
        os.getcwd()
    except FileNotFoundError:  # torch's import then dies in MKL's loader, with no word of why
        print(
            "flashrt_node: error: the working directory no longer exists (removed after the "
            "shell or service manager entered it): start the node from a folder that exists",
            file=sys.stderr,
        )
        return 2
    from flashrt_ros.node.signals import SignalWake

    # ours, not rclpy's (signals.py says why): a SIGTERM (docker stop, systemd, launch's
    # escalation) during the imports ends the process like a Ctrl-C, and one while the node
    # runs holds the robot first
    interrupts.install()
    from flashrt_ros.node import bytecode
    from flashrt_ros.node.memory import tune_malloc

    malloc_note = tune_malloc()  # before the first image is allocated (memory.py says why)
    bytecode_note = bytecode.enable()  # before torch is imported (bytecode.py says why)
    # One OpenMP thread per thread, unless the user exported a count, set before torch loads
    # OpenMP: its thread count is kept per calling thread, so the Engine's set_num_threads(1)
    # covers only the thread that built it. On a CPU device the control thread's first large op
    # then started an OpenMP worker, which inherited the control thread's name, CPU pin and
    # SCHED_FIFO priority and waited beside it (seen on a 2-core Xeon; test_node_timer).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import rclpy
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
    from rclpy.lifecycle import TransitionCallbackReturn
    from rclpy.logging import get_logger
    from rclpy.signals import SignalHandlerOptions

    from flashrt_ros.cuda.prewarm import warm_context
    from flashrt_ros.node.logs import forward_core_logs
    from flashrt_ros.node.params import ParamError

    # The control thread must get the GIL back promptly after the executor thread ran Python.
    sys.setswitchinterval(0.0005)
    try:
        rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    except KeyboardInterrupt:
        return stopped_early()
    except Exception as e:  # rcl refuses malformed --ros-args (RCLError): say so, no traceback
        # its log folder too: HOME unset or read-only (a systemd unit without User=)
        log_dir = re.search(r"log(ging)? directory", str(e), re.IGNORECASE)
        hint = "; set ROS_LOG_DIR to a folder this user can write" if log_dir else ""
        print(f"flashrt_node: error: {e}{hint}", file=sys.stderr)
        return 2
    node = executor = services = wake = None
    serving = False
    unforward = None
    try:
        try:
            cfg = _check_parameters(argv)  # before the slow imports: a bad one fails at once
            t_imports = time.monotonic()
            # the device's context is made beside the imports (cuda/prewarm.py says why)
            warmer = warm_context(cfg.device)
            with interrupts.deferred():  # a signal in torch's import ends the start after it
                from flashrt_ros.node.flashrt_node import FlashrtNode  # torch, the core

            node = FlashrtNode()
            unforward = forward_core_logs(node.get_logger())  # the core's `logging` records
            node.process_t0 = t_start
            node.startup["process + rclpy"] = t_imports - t_start
            node.startup["imports"] = time.monotonic() - t_imports
            node.context_warmer = warmer
            interrupts.log = node.get_logger().error
            interrupts.before_exit = node.hold_for_exit
            node.get_logger().info(malloc_note)
            if bytecode_note:
                node.get_logger().info(bytecode_note)
        except ParamError as e:
            log = get_logger(getattr(e, "logger", "flashrt"))
            for line in e.problems:
                log.fatal(line)
            log.fatal("bad parameters (see above); exiting with status 2")
            return 2
        # One executor thread for what is left on it: the lifecycle and parameter services and
        # the diagnostics timer (the inputs and the services have loops of their own; Python's
        # MultiThreadedExecutor measured 25x slower round trips).
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        wake = SignalWake(executor.wake)  # a signal during the spin is handled at once
        if node.get_parameter("autostart").value:
            node.defer_inputs = True
            if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
                node.get_logger().fatal("autostart: configure failed (see above); exiting")
                return 2
            node.trigger_activate()
        else:
            node.get_logger().info(
                "unconfigured (autostart: false): waiting for a lifecycle configure, e.g. "
                f"ros2 lifecycle set {node.get_fully_qualified_name()} configure"
            )
        # The inputs' loop (inputs.py) and the services' node, served by a loop and a thread of
        # their own (host.py says why), started only now: an observation that came during the
        # autostart transitions waits for the node to be active (it is stepped if still newer
        # than obs_timeout_s, not dropped as one to an inactive node), and a client that got an
        # answer knows the transitions are done (the node steps on what it is sent next), as
        # when all of it shared the executor, which was not spinning yet.
        node.defer_inputs = False
        services = node.service_host
        services.start()  # first: the inputs' loop of observation mode borrows them (inputs.py)
        node.start_inputs()
        serving = True
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        if not serving:  # before the node served (the imports, the autostart's configure)
            stopped_early()
    finally:
        interrupts.stopping = True  # from here on a Ctrl-C changes nothing
        if wake is not None:
            wake.close()
        if node is not None:
            node.stop_threads()
        if services is not None:
            services.stop(timeout=1.0)
        if executor is not None:
            executor.shutdown(timeout_sec=1.0)
        if node is not None:
            node.capsule_services.close()
            node.service_host.destroy()
            node.destroy_node()
        if unforward is not None:
            unforward()
        if rclpy.ok():
            rclpy.shutdown()
        if node is not None:
            node.flight.close()  # the stop's dump written; it also held the node (atexit)
        # Nothing may keep the node alive past the collection below (the hold is the last
        # reference): its handles keep the DDS participant, which goes with the context only.
        node = executor = services = wake = None
        interrupts.before_exit = interrupts.log = None
        # configure froze every object it had made (gc.freeze, flashrt_node.py): what of rclpy
        # sits in reference cycles among them would never be collected, and the DDS
        # participant never destroyed, leaving its shared-memory files in /dev/shm (a later
        # process given one of those ports receives nothing). Collect, then destroy it.
        gc.unfreeze()
        gc.collect()
        rclpy.get_default_context().destroy()
        # Python resets its handlers to the default (die by SIGINT or SIGTERM) while it
        # finalizes, which takes a while with DDS and torch threads about; an ignored signal
        # stays ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # ...and what is left is torch's heap, walked again by the interpreter's last
        # collection for nothing: frozen, a stop takes ~0.5 s instead of ~1 s (2-core machine)
        gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
