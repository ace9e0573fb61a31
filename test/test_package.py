"""The package as built by `make setup`: interfaces, node over DDS, launch and config files."""

from __future__ import annotations

import ast
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from test.ros_helpers import INSTALL_PREFIX, NODE_EXECUTABLE, PARAMS_FILE, REPO_ROOT


def declared_defaults() -> dict:
    """Every parameter and its default, from the one table (flashrt_ros/node/params.py)."""
    from flashrt_ros.node.params import NODE_PARAMS

    return NODE_PARAMS.defaults()


SERVICES = ["Checkpoint", "Restore", "Branch", "ListCapsules", "DropCapsule", "Rollout"]
EXECUTABLES = ["flashrt_node", "flashrt-replay", "flashrt-bagdiff", "flashrt_sim_arm"]


def test_dds_isolation_env(ros_domain):
    assert os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] == "LOCALHOST"
    assert os.environ["ROS_DOMAIN_ID"] == str(ros_domain)
    assert 101 <= ros_domain <= 200
    assert "ROS_STATIC_PEERS" not in os.environ  # contacted whatever the discovery range


def test_env_sh_drops_a_users_static_peers():
    """ROS contacts static peers even with LOCALHOST discovery: a user's list must not reach
    the shell env.sh sets up (nor, through it, any test, demo or benchmark)."""
    import subprocess

    env = dict(os.environ, ROS_STATIC_PEERS="192.0.2.1")
    out = subprocess.run(
        ["bash", "-c", '. ./env.sh >/dev/null 2>&1; echo "${ROS_STATIC_PEERS-unset}"'],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == "unset"


def test_params_file_has_every_default():
    data = yaml.safe_load(PARAMS_FILE.read_text())
    params = data["/**"]["ros__parameters"]
    declared = declared_defaults()
    assert params == declared, "regenerate: python -m flashrt_ros.node.params --yaml"
    assert list(params) == list(declared)  # in the table's order
    from flashrt_ros.node.params import NODE_PARAMS

    for p in NODE_PARAMS:  # each value has the declared type (rclpy types by value)
        assert isinstance(params[p.name], list if p.kind.endswith("_array") else p.pytype), p.name


def test_readme_parameter_table_is_the_declaration():
    """Users read the README: its table must be the one the node declares, not a copy."""
    from flashrt_ros.node.params import NODE_PARAMS

    readme = (REPO_ROOT / "README.md").read_text()
    begin, end = "<!-- params:begin -->\n", "<!-- params:end -->"
    table = readme[readme.index(begin) + len(begin) : readme.index(end)]
    assert table == NODE_PARAMS.markdown_table(), (
        "regenerate the README table: python -m flashrt_ros.node.params --markdown"
    )


def test_launch_file_declares_args_and_default_params():
    src = (REPO_ROOT / "launch" / "flashrt.launch.py").read_text()
    tree = ast.parse(src)
    declared = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "DeclareLaunchArgument"
    }
    assert {"namespace", "params_file", "device", "trigger"} <= declared
    assert {"joint_states_topic", "commands_topic", "goal_topic"} <= declared
    assert any(
        isinstance(f, ast.FunctionDef) and f.name == "generate_launch_description"
        for f in tree.body
    )
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    assert "flashrt_node" in strings and "flashrt_ros" in strings
    # the default params file is share/flashrt_ros/config/flashrt.yaml
    assert "config" in strings and "flashrt.yaml" in strings
    assert (REPO_ROOT / "config" / "flashrt.yaml").is_file()
    # a params_file:= naming no file is an error, not a node started on its defaults
    called = {getattr(n.func, "id", None) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "checked_params_file" in called
    installed = INSTALL_PREFIX / "share" / "flashrt_ros" / "config" / "flashrt.yaml"
    assert installed.is_file(), "config not installed: run `make setup`"
    params = yaml.safe_load(installed.read_text())["/**"]["ros__parameters"]
    assert params == declared_defaults()


def test_package_xml():
    root = ET.parse(REPO_ROOT / "package.xml").getroot()
    assert root.tag == "package" and root.get("format") == "3"
    assert root.findtext("name") == "flashrt_ros"
    assert root.find("export").findtext("build_type") == "ament_cmake"
    deps = {
        el.text for el in root if el.tag.endswith("depend") and el.tag != "test_depend" and el.text
    }
    for dep in [
        "rclpy",
        "std_msgs",
        "sensor_msgs",
        "trajectory_msgs",
        "diagnostic_msgs",
        "builtin_interfaces",
        "lifecycle_msgs",
        "rosidl_default_generators",
        "rosidl_default_runtime",
    ]:
        assert dep in deps, dep
    # what the launch files import (not this package, not the standard library), by the rosdep
    # key of the modules that have one of their own
    keys = {"yaml": "python3-yaml", "numpy": "python3-numpy", "PIL": "python3-pil"}
    launch_files = sorted((REPO_ROOT / "launch").glob("*.py"))
    assert launch_files
    for launch_file in launch_files:
        tree = ast.parse(launch_file.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        for top in {m.split(".")[0] for m in imported if m} - {"flashrt_ros"}:
            if top not in sys.stdlib_module_names:
                key = keys.get(top, top)
                assert key in deps, f"{launch_file.name} imports {top}, not in package.xml"
    assert "rosidl_default_generators" in {e.text for e in root.findall("buildtool_depend")}
    assert root.findtext("member_of_group") == "rosidl_interface_packages"
    assert "python3-pytest" in {e.text for e in root.findall("test_depend")}


def test_installed_layout():
    for exe in EXECUTABLES:
        path = INSTALL_PREFIX / "lib" / "flashrt_ros" / exe
        assert path.exists() and os.access(path, os.X_OK), path
    site = next((INSTALL_PREFIX / "lib").glob("python3.*/site-packages"))
    pkg = site / "flashrt_ros"
    # our __init__.py, not rosidl's empty one; our subpackages beside msg/ and srv/
    assert (pkg / "__init__.py").resolve() == (REPO_ROOT / "flashrt_ros" / "__init__.py")
    for sub in ["msg", "srv", "runtime", "capsules", "policies", "replay", "sim", "node"]:
        assert (pkg / sub / "__init__.py").exists(), sub
    # symlink install: edits of source files are live in install/
    assert (pkg / "runtime" / "__init__.py").resolve() == (
        REPO_ROOT / "flashrt_ros" / "runtime" / "__init__.py"
    )


def test_generated_interfaces_import():
    pytest.importorskip("rclpy", reason="rclpy not importable: run via `make test`")
    import flashrt_ros.srv as srv
    from flashrt_ros.msg import CapsuleInfo

    info = CapsuleInfo()
    assert info.id == "" and info.step == 0 and info.pinned is False
    assert type(info.stamp).__name__ == "Time"
    shipped = sorted(p.stem for p in (REPO_ROOT / "srv").glob("*.srv"))
    assert set(SERVICES) <= set(shipped)
    for name in shipped:  # every .srv in the package, contract ones and extensions
        cls = getattr(srv, name)
        cls.Request()
        cls.Response()
    resp = srv.ListCapsules.Response()
    assert list(resp.capsules) == [] and resp.live_session == ""
    req = srv.Rollout.Request(observations=[0.0, 1.0], n_steps=1)
    assert list(req.observations) == [0.0, 1.0]
    assert hasattr(srv.Branch.Request(), "goal")


def test_node_offers_list_capsules_over_dds(ros, start_node):
    from flashrt_ros.srv import ListCapsules

    assert NODE_EXECUTABLE.exists()
    node = start_node({"device": "cpu"})
    assert node.alive()
    client = ros.client(ListCapsules, node.service("list_capsules"))
    resp = ros.call(client, ListCapsules.Request(), timeout=20.0)
    assert isinstance(resp, ListCapsules.Response)
    node.stop()
    assert not node.alive()


def test_node_in_namespace(ros):
    from flashrt_ros.srv import ListCapsules

    node = ros.start_node({"device": "cpu"}, namespace="arm_a")
    assert node.service("list_capsules") == "/arm_a/flashrt/list_capsules"
    resp = ros.call(ros.client(ListCapsules, node.service("list_capsules")), ListCapsules.Request())
    assert isinstance(resp, ListCapsules.Response)


def test_a_second_node_of_the_same_name_is_warned_about(ros):
    """Two arms, the second started without its namespace:=: ROS runs both as /twins/flashrt
    without a word, each publishing commands, and a monitor of /diagnostics sees one entry
    (integrator review). Each node now says so, in its status and its log."""
    from test.node_client import NodeClient

    params = {"device": "cpu", "trigger": "observation"}
    a = ros.start_node(params, namespace="twins")
    b = ros.start_node(params, namespace="twins")
    c = NodeClient(ros, a)
    d = c.wait_diag(lambda d: d.get("same_name_nodes") == "2", 20)
    assert d["_level"] == 1 and "2 nodes named /twins/flashrt" in d["_message"], d
    for p in (a, b):
        end = time.monotonic() + 20
        while "2 nodes named /twins/flashrt on the graph" not in p.log_tail(200):
            assert time.monotonic() < end, p.log_tail()
            time.sleep(0.2)


def test_rmw_is_fastrtps():
    rclpy = pytest.importorskip("rclpy", reason="rclpy not importable: run via `make test`")
    from rclpy.utilities import get_rmw_implementation_identifier

    assert get_rmw_implementation_identifier() == "rmw_fastrtps_cpp"
    assert Path(rclpy.__file__).exists()


def test_make_setup_again_rebuilds_nothing():
    """`make test` ran setup just before: a second setup must find everything up to date."""
    import subprocess

    out = subprocess.run(
        ["make", "--no-print-directory", "setup"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "requirements up to date" in out.stdout
    assert "colcon build up to date" in out.stdout, out.stdout
