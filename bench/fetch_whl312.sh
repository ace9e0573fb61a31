#!/usr/bin/env bash
# The cp312 wheel set that bench/ros_gpu.sh installs on the GPU machine (Python 3.12, no ROS,
# no network), derived from this checkout's .venv so that it always matches `make setup`:
#   bash bench/fetch_whl312.sh [DIR]        (default DIR: .whl312, ignored by git)
# Every distribution in .venv is fetched for CPython 3.12 at the same version, except the ones
# the GPU image already has (torch, numpy, cuda-python, pytest, ...: SKIP below) and the
# component records that ROS wheels install beside themselves (e.g. `rclpy` inside `ros-rclpy`),
# which PyPI does not serve. empy has no wheel on PyPI: it is built here. Then the set is checked:
# a fresh Python 3.12 venv (when python3.12 is on PATH) installs it offline, with no index and
# no dependencies, and must import rclpy, the message packages and colcon.
set -eo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DIR="${1:-.whl312}"
VENV_PY=".venv/bin/python"
[ -x "$VENV_PY" ] || { echo "fetch_whl312: no .venv here; run 'make setup' first" >&2; exit 2; }
grep -qsx '/.whl312/' .git/info/exclude || { mkdir -p .git/info && echo '/.whl312/' >> .git/info/exclude; }
mkdir -p "$DIR"

# On the GPU image already (its package list), or not needed by the node and the bench there
# (rosbags is: the node decodes camera images with it).
SKIP='^(torch|numpy|cuda-python|cuda-bindings|cuda-core|cuda-pathfinder|nvidia-.*|triton|pip|setuptools|pytest.*|pluggy|iniconfig|coverage|ruff|matplotlib|contourpy|cycler|fonttools|kiwisolver|pillow|pyparsing|python-dateutil|six|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec|typing-extensions|typing_extensions|pyyaml|packaging|pygments|tzdata|flashrt-ros)$'

mapfile -t all < <("$VENV_PY" -m pip list --format=freeze --disable-pip-version-check 2>/dev/null)
ros_dists=" $(printf '%s\n' "${all[@]}" | sed -n 's/^ros-\([^=]*\)==.*/\1/p' | tr '_' '-' | tr '\n' ' ') "
want=()
for line in "${all[@]}"; do
  name="${line%%==*}"; lname="$(echo "$name" | tr 'A-Z_' 'a-z-')"
  [[ "$lname" =~ $SKIP ]] && continue
  # a component record of a ros-* wheel (rclpy, std_msgs, ...): served inside that wheel
  [[ "$lname" != ros-* && "$ros_dists" == *" $lname "* ]] && continue
  want+=("$line")
done
echo "fetch_whl312: ${#want[@]} distributions for cp312 into $DIR"
fail=()
for spec in "${want[@]}"; do
  case "$spec" in
    empy==*)
      ls "$DIR"/empy-* >/dev/null 2>&1 || "$VENV_PY" -m pip wheel -q --no-deps "$spec" -w "$DIR" ||
        fail+=("$spec")
      continue ;;
  esac
  "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    --disable-pip-version-check -d "$DIR" "$spec" >/dev/null 2>&1 || fail+=("$spec")
done
if [ ${#fail[@]} -gt 0 ]; then
  echo "fetch_whl312: FAILED to fetch: ${fail[*]}" >&2
  exit 1
fi
echo "fetch_whl312: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sm "$DIR" | cut -f1) MB"

# ---- the check: an offline install into a fresh 3.12 venv must give a working ROS client
PY312=""
for c in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -V >/dev/null 2>&1; then PY312="$(command -v "$c")"; break; fi
done
if [ -z "$PY312" ]; then
  echo "fetch_whl312: no python3.12 here: the set is fetched but not checked"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY312" -m venv "$tmp/v"
# numpy comes from the GPU image there; the check venv takes it from the index
"$tmp/v/bin/python" -m pip install -q --disable-pip-version-check numpy setuptools pyyaml packaging typing_extensions
_ROS_WHEELS_BOOTSTRAP_COMPLETE=1 "$tmp/v/bin/python" -m pip install -q --no-index --no-deps \
  --disable-pip-version-check "$DIR"/*.whl
# shellcheck disable=SC2016
if ! ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST ROS_DOMAIN_ID=231 "$tmp/v/bin/python" -c '
import importlib
for m in ("rclpy", "rclpy.lifecycle", "std_msgs.msg", "sensor_msgs.msg", "trajectory_msgs.msg",
          "diagnostic_msgs.msg", "lifecycle_msgs.msg", "rcl_interfaces.msg", "colcon_core",
          "colcon_ros", "catkin_pkg", "em", "lark", "argcomplete", "rosidl_generator_py",
          "rosbags.typesys"):
    importlib.import_module(m)
print("fetch_whl312: check passed: rclpy, messages and colcon import under", __import__("sys").version.split()[0])
'; then
  echo "fetch_whl312: FAILED: the wheel set does not import in a fresh Python 3.12 venv" >&2
  exit 1
fi
