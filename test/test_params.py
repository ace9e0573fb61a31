"""Parameters: one table (flashrt_ros/node/params.py) checks every value the same way for
--params-file, -p and `ros2 param set`. A bad one makes the node exit with status 2, naming it
and what it accepts; read-only ones refuse a set over DDS; --help and config/flashrt.yaml come
from the table; a second Ctrl-C during shutdown still ends the node cleanly."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from test.conftest import require_rclpy
from test.node_client import set_params as _set
from test.ros_helpers import NODE_EXECUTABLE, REPO_ROOT, importable_tests, launch_node

BAD = [  # (overrides, the parameter the error names): one of each class of bad value
    ({"obs_timeout_s": math.nan}, "obs_timeout_s"),
    ({"rate_hz": math.inf}, "rate_hz"),
    ({"obs_limit": -math.inf}, "obs_limit"),
    ({"capsule_slots": 0}, "capsule_slots"),
    ({"rate_hz": 1e6}, "rate_hz"),
    ({"flight_ticks": -1}, "flight_ticks"),
    ({"capsule_slots": "abc"}, "capsule_slots"),
    ({"seed": 1.5}, "seed"),
    ({"autostart": 1}, "autostart"),
    ({"joint_names": []}, "joint_names"),
    ({"joint_names": None}, "joint_names"),  # how rcl hands over an empty YAML list
    ({"joint_names": ["a", "a"]}, "joint_names"),
    ({"trigger": "sometimes"}, "trigger"),
    ({"device": "gpu"}, "device"),
    ({"cameras": ["front cam"]}, "cameras"),
    ({"cameras": ["a", "a"]}, "cameras"),
    ({"publish_offset_s": 0.01}, "publish_offset_s"),  # not below 1/rate_hz = 0.01
    ({"step_on": []}, "step_on"),
    ({"trigger": "observation", "cameras": ["top"], "step_on": ["side"]}, "step_on"),
    ({"cameras": ["top"], "step_on": ["top"]}, "step_on"),  # the timer steps at rate_hz
    ({"trigger": "observation", "cameras": ["joint_states"]}, "cameras"),
    ({"cpu_affinity": "two"}, "cpu_affinity"),
    ({"cpu_affinity": "2,"}, "cpu_affinity"),
    ({"cpu_affinity": "5-2"}, "cpu_affinity"),  # a range that runs backwards
    ({"cpu_affinity": "0-99999999"}, "cpu_affinity"),
    ({"cpu_affinity": -1}, "cpu_affinity"),
    ({"cpu_affinity": True}, "cpu_affinity"),
    ({"cpu_affinity": 1.0}, "cpu_affinity"),
]


# -- the table, without ROS ------------------------------------------------------------------


def test_config_has_one_frozen_field_per_parameter():
    from flashrt_ros.node.params import DEFAULT_JOINTS, NODE_PARAMS, NodeConfig

    cfg = NODE_PARAMS.config({})
    assert [f.name for f in dataclasses.fields(NodeConfig)] == NODE_PARAMS.names
    assert {"flight_ticks", "cameras", "obs_limit", "max_rollout_steps"} <= set(NODE_PARAMS.names)
    assert cfg.joint_names == tuple(DEFAULT_JOINTS) and cfg.cameras == ()
    assert cfg.flight_ticks == 0 and cfg.obs_limit == 1000.0 and cfg.max_rollout_steps == 10000
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.obs_timeout_s = 1.0
    live = {p.name for p in NODE_PARAMS if p.live}
    assert {"obs_timeout_s", "publish_offset_s", "max_rollout_steps"} <= live
    # configure bakes these into the engine, the mapper or the graphs: a set needs a reconfigure
    assert not live & {"rate_hz", "joint_names", "obs_limit", "flight_ticks", "cameras", "device"}


@pytest.mark.parametrize("values,name", BAD, ids=[f"{n}={v[n]!r}" for v, n in BAD])
def test_bad_value_is_refused_naming_the_parameter(values, name):
    from flashrt_ros.node.params import NODE_PARAMS, ParamError

    with pytest.raises(ParamError) as e:
        NODE_PARAMS.config(values)
    assert str(e.value).startswith(f"parameter {name}=") and "; accepts " in str(e.value)


def test_cpu_lists_read_as_taskset_reads_them():
    from flashrt_ros.node.params import parse_cpus

    assert parse_cpus("") == frozenset()
    assert parse_cpus("3") == {3}
    assert parse_cpus("0,2-4,9") == {0, 2, 3, 4, 9}
    assert parse_cpus("4-4") == {4}
    for bad in ("5-2", " 3", "3 ", "-1", "1,,2", "a", "0-99999999999"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_one_cpu_given_as_a_bare_number_is_that_cpu():
    """rcl reads `cpu_affinity: 3` (unquoted) as the integer 3; it means CPU 3."""
    from flashrt_ros.node.params import NODE_PARAMS

    assert NODE_PARAMS.config({"cpu_affinity": 3}).cpu_affinity == "3"


def test_integers_are_taken_where_doubles_are_declared():
    from flashrt_ros.node.params import NODE_PARAMS

    cfg = NODE_PARAMS.config({"rate_hz": 500, "obs_timeout_s": 2, "obs_limit": 7})
    assert (cfg.rate_hz, cfg.obs_timeout_s, cfg.obs_limit) == (500.0, 2.0, 7.0)
    assert all(type(x) is float for x in (cfg.rate_hz, cfg.obs_timeout_s, cfg.obs_limit))


def test_params_module_imports_no_ros():
    """tools/ and the demo take DEFAULT_JOINTS from it where ROS may be missing."""
    code = (
        "import sys, flashrt_ros.node.params as p; "
        "assert p.DEFAULT_JOINTS == [f'joint{i}' for i in range(1, 7)]; "
        "ros = [m for m in sys.modules if m.split('.')[0] in ('rclpy', 'rcl_interfaces')]; "
        "assert not ros, ros"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert out.returncode == 0, out.stderr


def test_help_lists_every_parameter_and_service():
    from flashrt_ros.node.params import NODE_PARAMS

    out = subprocess.run(
        [sys.executable, str(NODE_EXECUTABLE), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for p in NODE_PARAMS:
        mode = "live" if p.live else "read-only"
        assert f"  {p.name} ({p.kind}, default {p.yaml_value()}; {mode}" in text, p.name
        assert p.help in text and f"accepts {p.accepts()}" in text, p.name
    shipped = sorted(f.stem for f in (REPO_ROOT / "srv").glob("*.srv"))
    assert len(shipped) >= 10
    for name in shipped:
        snake = re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()
        assert f"~/{snake} " in text, snake


def test_a_start_that_cannot_begin_says_why_in_one_line(tmp_path):
    """A systemd unit or a shell whose working directory was removed: torch's import died in
    MKL's loader with no word of why. A HOME that cannot hold ROS's log folder: rcl's line
    gave no way out."""
    gone = tmp_path / "gone"
    gone.mkdir()
    script = f'cd "{gone}" && rmdir "{gone}" && exec "{sys.executable}" "{NODE_EXECUTABLE}"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "the working directory no longer exists" in out.stderr, out.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "ROS_LOG_DIR", "ROS_HOME")}
    out = subprocess.run(
        [sys.executable, str(NODE_EXECUTABLE)], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 2, out.stderr
    assert "set ROS_LOG_DIR to a folder this user can write" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    # another logging failure gets no advice about the folder
    out = subprocess.run(
        [sys.executable, str(NODE_EXECUTABLE), "--ros-args", "--log-config-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "flashrt_node: error:" in out.stderr, out.stderr
    assert "ROS_LOG_DIR" not in out.stderr, out.stderr


@pytest.mark.parametrize("extra", [[], ["--ros-args", "-p", "rate_hz:=100.0"]])
def test_sim_arm_help_lists_its_parameters_and_starts_no_node(extra):
    """`flashrt_sim_arm --help` used to start a publishing arm; it must only print its help,
    also when ROS arguments follow."""
    require_rclpy()
    from flashrt_ros.sim.arm_node import SIM_PARAMS

    out = subprocess.run(
        [sys.executable, str(NODE_EXECUTABLE.with_name("flashrt_sim_arm")), "--help", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: flashrt_sim_arm")
    for p in SIM_PARAMS:
        assert f"  {p.name} ({p.kind}, default {p.yaml_value()}" in out.stdout, p.name
    assert "simulated arm" not in out.stderr  # the node's start-up line: no node was made


def test_help_is_asked_before_ros_args_only():
    from flashrt_ros.node.params import wants_help

    assert wants_help(["x", "--help"]) and wants_help(["x", "-h", "--ros-args", "-p", "a:=1"])
    assert not wants_help(["x", "--ros-args", "-r", "__node:=help"])
    assert not wants_help(["x"]) and not wants_help(["x", "--ros-args", "--help"])


def test_json_param_values_roundtrip():
    """The harness writes -p values as JSON: NaN and Infinity must reach rcl as numbers."""
    from flashrt_ros.node.params import rcl_value

    assert math.isnan(rcl_value(json.dumps(math.nan)))
    assert rcl_value(json.dumps(math.inf)) == math.inf
    assert rcl_value(json.dumps([])) is None


def test_p_rules_are_read_as_rcl_reads_them(ros_domain):
    """The check of -p rules that rcl drops must see each value exactly as rcl types it."""
    require_rclpy()
    import rclpy
    from rclpy.context import Context

    from flashrt_ros.node.params import cli_overrides

    tokens = ["1e-3", "0x10", "010", ".nan", "nan", "-.inf", "y", "on", "No", "1_000", "+5"]
    tokens += ['"5"', "'x'", "1.5e3", "5.", "cuda:0", "1:30", "~", "[1, 2]", "[]", '[a, "b"]']
    tokens += ["1e400", "abc"]
    argv = ["prog", "--ros-args"]
    for i, t in enumerate(tokens):
        argv += ["-p", f"p{i}:={t}"]
    context = Context()
    rclpy.init(args=argv, context=context, domain_id=ros_domain)
    try:
        node = rclpy.create_node("flashrt", context=context, enable_rosout=False)
        rcl = {n: q.value for n, q in node._parameter_overrides.items()}
        node.destroy_node()
    finally:
        rclpy.shutdown(context=context)
    ours = cli_overrides(argv, "flashrt")
    for i, t in enumerate(tokens):
        a, b = rcl[f"p{i}"], ours[f"p{i}"][1]
        a = a.tolist() if hasattr(a, "tolist") else a
        same = type(a) is type(b) and (a == b or (a != a and b != b))  # nan == nan
        assert same, f"{t!r}: rcl {a!r}, ours {b!r}"


# -- node processes ------------------------------------------------------------------------------


def _wait(proc, timeout: float = 60.0) -> int | None:
    try:
        return proc.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _catches_sigterm(pid: int, timeout: float) -> bool:
    """Whether process `pid` installs a SIGTERM handler within `timeout` s (/proc's SigCgt)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/status") as f:
                mask = next(ln for ln in f if ln.startswith("SigCgt:")).split()[1]
        except (OSError, StopIteration):
            return False
        if int(mask, 16) >> (signal.SIGTERM - 1) & 1:
            return True
        time.sleep(0.005)
    return False


@pytest.mark.exclusive
@pytest.mark.parametrize("after_s", [0.2, 1.0, 2.0])
def test_sigterm_while_the_node_starts_ends_it_cleanly(tmp_path, ros_domain, after_s):
    """docker stop, systemd and launch's escalation send SIGTERM. During the imports rclpy's
    handler shut rcl down and the node was then made on a context gone: a traceback and exit
    1. It ends now as after Ctrl-C, with status 0, at any point of the start."""
    require_rclpy()
    proc = launch_node({"device": "cpu"}, log_dir=tmp_path / "term")
    # from the node's first lines on: before them the interpreter is still starting (on a busy
    # 2-core machine for longer than 0.2 s) and SIGTERM ends it by default, status -15, which
    # systemd and launch count as a clean stop as well
    assert _catches_sigterm(proc.pid, 30.0), proc.log_tail()
    time.sleep(after_s)
    proc.proc.send_signal(signal.SIGTERM)
    rc = _wait(proc, 30.0)
    log = proc.log_path.read_text(errors="replace")
    assert rc == 0, f"rc {rc}\n{log}"
    assert "Traceback" not in log, log
    # and says so, serving or not yet (a launch's log ended with nothing from the node); at
    # 0.2 s it is still importing torch on any machine
    early = "stopped by a signal during start-up, before serving"
    said = (early,) if after_s < 0.5 else (early, "stopping (signal)")
    assert any(s in log for s in said), log


def test_a_policy_that_cannot_be_built_fails_configure_saying_why(tmp_path, ros_domain):
    """An error of any kind while configuring (here the policy's state_spec raises KeyError) is
    logged with its type and text and the node exits 2: rclpy alone would report the failed
    transition without a word about its cause."""
    with importable_tests():
        proc = launch_node(
            {"device": "cpu", "policy": "test.tiny_policy:unbuildable"}, log_dir=tmp_path
        )
    try:
        rc = _wait(proc)
        log = proc.log_path.read_text(errors="replace")
        assert rc == 2, f"{proc}: rc {rc}, expected 2\n{log}"
        assert "configure failed: KeyError: 'observation.missing'" in log, log
    finally:
        proc.stop()


def test_bad_parameters_make_the_node_exit_2_naming_them(tmp_path, ros_domain):
    cases = [  # -p overrides on top of config/flashrt.yaml: (params, names in the log)
        ({"obs_timeout_s": math.nan}, ["obs_timeout_s"]),
        ({"rate_hz": math.inf}, ["rate_hz"]),
        ({"capsule_slots": 0, "obs_limit": -1.0}, ["capsule_slots", "obs_limit"]),
        ({"capsule_slots": "abc"}, ["capsule_slots"]),  # rcl drops it: the node must not
        ({"joint_names": []}, ["joint_names"]),  # also dropped by rcl
        ({"joint_names": ["a", "b", "a"]}, ["joint_names"]),
        ({"trigger": "sometimes", "autostart": False}, ["trigger"]),  # even without autostart
        ({"cameras": ["front cam"]}, ["cameras"]),
        ({"rate_hz": 50, "publish_offset_s": 0.05}, ["publish_offset_s"]),
    ]
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(
        "/**:\n  ros__parameters:\n    obs_timeout_s: .nan\n    seed: x\n    joint_names: []\n"
    )
    procs = []
    for i, (params, names) in enumerate(cases):
        procs.append((launch_node({"device": "cpu", **params}, log_dir=tmp_path / f"p{i}"), names))
        # a little apart: ten DDS participants starting in the same instant on a 2-core machine
        # once left one of them silent for 30 s (a fresh-clone run; never seen alone)
        time.sleep(0.2)
    procs.append(
        (
            launch_node({"device": "cpu"}, log_dir=tmp_path / "yaml", params_file=bad_yaml),
            ["obs_timeout_s", "seed", "joint_names"],
        )
    )
    # a second arm's node: its lines carry its namespace (both processes are flashrt_node)
    arm = launch_node(
        {"device": "cpu", "rate_hz": -1.0}, log_dir=tmp_path / "arm", namespace="arm_right"
    )
    procs.append((arm, ["rate_hz"]))
    try:
        for proc, names in procs:
            rc = _wait(proc)
            log = proc.log_path.read_text(errors="replace")
            assert rc == 2, f"{proc}: rc {rc}, expected 2\n{log}"
            who = "arm_right.flashrt" if proc is arm else "flashrt"
            for name in names:
                assert re.search(rf"\[{who}\]: parameter {name}=.*; accepts ", log), log
            assert "Traceback" not in log, log
    finally:
        for proc, _ in procs:
            proc.stop()


@pytest.fixture(scope="module")
def live(ros_module):
    """One node for the checks over DDS: rate_hz given as an integer, one misspelt parameter."""
    proc = ros_module.start_node(
        {"device": "cpu", "rate_hz": 20, "obs_timout_s": 1.0},
        wait_services=("list_capsules", "rollout", "set_parameters"),
    )
    yield ros_module, proc
    proc.stop()


def _get(ros, proc, *names):
    from rcl_interfaces.srv import GetParameters
    from rclpy.parameter import parameter_value_to_python

    req = GetParameters.Request(names=list(names))
    resp = ros.call(ros.client(GetParameters, proc.service("get_parameters")), req)
    return [(v.type, parameter_value_to_python(v)) for v in resp.values]


@pytest.mark.exclusive
def test_integer_for_double_is_taken_and_sets_the_rate(live):
    from rcl_interfaces.msg import ParameterType
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray

    ros, proc = live
    assert _get(ros, proc, "rate_hz") == [(ParameterType.PARAMETER_DOUBLE, 20.0)]
    got = []
    pub = ros.node.create_publisher(JointState, proc.topic("joint_states"), 10)
    sub = ros.node.create_subscription(
        Float64MultiArray, proc.topic("commands"), lambda m: got.append(time.monotonic()), 100
    )
    names = [f"joint{i}" for i in range(1, 7)]
    try:
        end = time.monotonic() + 4.0
        while time.monotonic() < end:  # fresh observations at 100 Hz; commands at the tick rate
            pub.publish(JointState(name=names, position=[0.0] * 6, velocity=[0.0] * 6))
            ros.spin_for(0.01)
    finally:
        ros.node.destroy_publisher(pub)
        ros.node.destroy_subscription(sub)
    window = [t for t in got if t > got[0] + 0.5] if got else []
    assert len(window) >= 10, f"{len(got)} commands"
    rate = (len(window) - 1) / (window[-1] - window[0])
    assert 5.0 < rate < 40.0, f"{rate:.1f} Hz, expected 20"


def test_read_only_parameters_refuse_a_set_over_dds(live):
    from rcl_interfaces.msg import ParameterType

    from flashrt_ros.node.params import NODE_PARAMS

    ros, proc = live
    fixed = [p for p in NODE_PARAMS if not p.live]
    results = _set(ros, proc, **{p.name: p.default if p.default != [] else ["x"] for p in fixed})
    for (ok, reason), p in zip(results, fixed, strict=True):
        assert not ok and "read-only" in reason, (p.name, reason)
    # an empty default is still a typed string array
    assert _get(ros, proc, "cameras") == [(ParameterType.PARAMETER_STRING_ARRAY, [])]


def test_a_set_of_a_parameter_the_node_lacks_names_it_and_the_one_meant(live):
    from rcl_interfaces.msg import ParameterType
    from rcl_interfaces.srv import SetParametersAtomically
    from rclpy.parameter import Parameter

    ros, proc = live
    ok, reason = _set(ros, proc, obs_timeout=0.1)[0]
    assert not ok, reason
    assert "the node has no parameter 'obs_timeout' (did you mean obs_timeout_s?)" in reason
    ok, reason = _set(ros, proc, use_sim_tme=True)[0]  # rclpy's own parameters are meant too
    assert not ok and "(did you mean use_sim_time?)" in reason, reason
    # all or nothing: a known parameter beside an unknown one is not set either
    req = SetParametersAtomically.Request(
        parameters=[
            Parameter("obs_timeout_s", value=3.0).to_parameter_msg(),
            Parameter("no_such_thing", value=1).to_parameter_msg(),
        ]
    )
    client = ros.client(SetParametersAtomically, proc.service("set_parameters_atomically"))
    result = ros.call(client, req).result
    assert not result.successful and "'no_such_thing'" in result.reason, result.reason
    assert _get(ros, proc, "obs_timeout_s") == [(ParameterType.PARAMETER_DOUBLE, 0.5)]


def test_live_parameter_set_is_checked_and_applied(live):
    from rcl_interfaces.msg import ParameterType

    from flashrt_ros.srv import Rollout

    ros, proc = live
    assert _set(ros, proc, obs_timeout_s=math.nan)[0][0] is False
    assert _set(ros, proc, max_rollout_steps=0)[0][0] is False
    ok, reason = _set(ros, proc, publish_offset_s=0.05)[0]  # the period of 20 Hz
    assert not ok and "publish_offset_s" in reason and "1/rate_hz" in reason
    # a value of another type: named, with what it accepts (rclpy said "expected '3' got '4'")
    ok, reason = _set(ros, proc, obs_timeout_s="abc")[0]
    assert not ok and reason.startswith("parameter obs_timeout_s='abc'") and "accepts" in reason
    ok, reason = _set(ros, proc, max_rollout_steps=5.0)[0]
    assert not ok and "max_rollout_steps" in reason and "not an integer" in reason, reason
    assert _get(ros, proc, "obs_timeout_s", "publish_offset_s") == [
        (ParameterType.PARAMETER_DOUBLE, 0.5),
        (ParameterType.PARAMETER_DOUBLE, 0.0),
    ]
    assert _set(ros, proc, obs_timeout_s=2) == [(True, "")]  # an integer, stored as a double
    assert _get(ros, proc, "obs_timeout_s") == [(ParameterType.PARAMETER_DOUBLE, 2.0)]
    # applied at once: ~/rollout reads max_rollout_steps from the node's current config
    rollout = ros.client(Rollout, proc.service("rollout"))

    def roll(n):
        return ros.call(rollout, Rollout.Request(observations=[0.0] * 12 * n, n_steps=n))

    assert roll(4).success
    assert _set(ros, proc, max_rollout_steps=3) == [(True, "")]
    resp = roll(4)
    assert not resp.success and "max_rollout_steps" in resp.message
    assert roll(3).success
    assert _set(ros, proc, max_rollout_steps=10000, obs_timeout_s=0.5) == [(True, "")] * 2
    # rclpy's own parameters stay settable, and setting one leaves the node up
    assert _set(ros, proc, use_sim_time=False) == [(True, "")]
    assert roll(1).success
    # each change at runtime leaves a line in the log, accepted or refused, with the old value
    log = proc.log_path.read_text(errors="replace")
    assert "parameters set: max_rollout_steps=3 (was 10000)" in log, log[-3000:]
    assert "parameter set refused (publish_offset_s=0.05 (was 0.0)): " in log, log[-3000:]


def test_unknown_parameter_is_reported(live):
    _, proc = live
    log = proc.log_path.read_text(errors="replace")
    assert "unknown parameter 'obs_timout_s' ignored (did you mean obs_timeout_s?)" in log


def test_repeated_sigint_during_shutdown_ends_cleanly(live):
    """`ros2 launch` forwards Ctrl-C while the terminal's own SIGINT already has the node
    shutting down: the later ones must not turn into a KeyboardInterrupt traceback."""
    _, proc = live
    assert proc.alive()
    for gap in (0.0, 0.005, 0.02, 0.05, 0.1):
        time.sleep(gap)
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGINT)
    rc = _wait(proc, 30.0)
    log = proc.log_path.read_text(errors="replace")
    assert rc == 0, f"rc {rc}\n{log}"
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log


def test_a_p_rule_under_a_section_naming_the_node_is_reported_with_its_real_cause(
    tmp_path, ros_domain
):
    """A params file keyed by the node's name wins over `-p` (which joins `/**`): the node
    refuses to start, as for any dropped rule, but it blamed the value's type, which was right
    (a double for a double), and sent the integrator after the wrong thing."""
    arm = tmp_path / "arm.yaml"
    arm.write_text("/flashrt:\n  ros__parameters:\n    rate_hz: 100.0\n")
    proc = launch_node(
        {"device": "cpu"}, ["--params-file", str(arm), "-p", "rate_hz:=50.0"], log_dir=tmp_path
    )
    try:
        assert _wait(proc) == 2, proc.log_tail()
        log = proc.log_path.read_text(errors="replace")
        assert "rate_hz:=50.0 was not applied" in log and "takes precedence over -p" in log, log
        assert "another type" not in log, log
    finally:
        proc.stop()


def test_params_file_sections_that_miss_the_node_are_reported(tmp_path):
    """rcl applies no section of a params file that names another node, and says nothing: a
    file keyed `flashrt:` (that is /flashrt) for /arm/flashrt left the node on its defaults."""
    from flashrt_ros.node.params import checked_params_file, unmatched_params_files

    def warns(text: str, fqn: str) -> list[str]:
        f = tmp_path / "p.yaml"
        f.write_text(text)
        return unmatched_params_files(["x", "--ros-args", "--params-file", str(f)], fqn)

    body = ":\n  ros__parameters:\n    rate_hz: 50.0\n"
    (w,) = warns("flashrt" + body, "/arm/flashrt")
    assert "no section applies to this node /arm/flashrt" in w and "flashrt" in w
    for key in ("/**", "/arm/flashrt", "/*/flashrt", "/**/flashrt", "arm/flashrt"):
        assert warns(key + body, "/arm/flashrt") == [], key
    assert warns("flashrt" + body, "/flashrt") == []
    assert warns("/left/flashrt" + body + "/right/flashrt" + body, "/arm/flashrt")
    assert unmatched_params_files(["x", "--params-file", "nope.yaml"], "/flashrt") == []
    assert checked_params_file(str(tmp_path / "p.yaml")) == str(tmp_path / "p.yaml")
    with pytest.raises(FileNotFoundError, match="params_file:=.*act.yml: no such file"):
        checked_params_file(str(tmp_path / "act.yml"))
    # a file cut short in a deploy: rcl takes it, and the node would run on its defaults
    for text in ("", "\n", "# robot cell 3\n"):
        (tmp_path / "empty.yaml").write_text(text)
        with pytest.raises(ValueError, match="is empty"):
            checked_params_file(str(tmp_path / "empty.yaml"))
    (w,) = warns("# robot cell 3\n", "/arm/flashrt")
    assert "is empty (or only comments)" in w, w


def test_a_node_says_what_went_wrong_at_the_command_line(tmp_path, ros_domain):
    """One clear line, no traceback: a namespace rcl refuses (exit 2; it was a traceback and
    exit 1), `--help` piped into `head` (a BrokenPipeError traceback, exit 1), and a node
    started with a params file for another node name and autostart false says both."""
    bad_ns = launch_node({"device": "cpu"}, ["-r", "__ns:=/arm/"], log_dir=tmp_path / "ns")
    arm = tmp_path / "arm.yaml"
    arm.write_text("flashrt:\n  ros__parameters:\n    rate_hz: 50.0\n")
    waiting = launch_node(
        {"device": "cpu", "autostart": False},
        ["--params-file", str(arm)],
        log_dir=tmp_path / "arm",
        namespace="arm",
    )
    try:
        help_ = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {sys.executable} {NODE_EXECUTABLE} --help | head -1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert help_.returncode == 0 and "Traceback" not in help_.stderr, help_.stderr
        sim = subprocess.run(
            [sys.executable, str(NODE_EXECUTABLE.with_name("flashrt_sim_arm"))]
            + ["--ros-args", "-r", "__ns:=/arm/"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sim.returncode == 2 and "Traceback" not in sim.stderr, sim.stderr
        assert "flashrt_sim_arm: error:" in sim.stderr, sim.stderr
        assert _wait(bad_ns) == 2, bad_ns.log_tail()
        log = bad_ns.log_path.read_text(errors="replace")
        assert "the node cannot be made" in log and "Traceback" not in log, log
        end = time.monotonic() + 60
        while "waiting for a lifecycle configure" not in (log := waiting.log_tail(200)):
            assert time.monotonic() < end and waiting.alive(), log
            time.sleep(0.2)
        assert "no section applies to this node /arm/flashrt" in log, log
    finally:
        bad_ns.stop()
        waiting.stop()
