# shellcheck shell=bash
# flashrt_ros environment. Source it from the repository root or anywhere: `. ./env.sh`
#  - activates .venv (the pinned ROS 2 Kilted wheels, torch, tools; `make setup` creates it)
#  - puts the colcon workspace install/ (built by `make setup`) on the paths
#  - fixes the quirks of the ROS PyPI wheels (see below)
#  - keeps DDS on this machine: ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST and a ROS_DOMAIN_ID.
# Safe to source more than once and under `set -u`.

# --- shell options: tolerate `set -u` / `set -e` in the caller, restore them at the end
_flashrt_opts="$-"
set +u
set +e

_flashrt_src=""
if [ -n "${BASH_VERSION:-}" ]; then
  eval '_flashrt_src="${BASH_SOURCE[0]:-}"'
fi
if [ -n "$_flashrt_src" ]; then
  _flashrt_root="$(cd "$(dirname "$_flashrt_src")" && pwd)"
elif [ -n "${ZSH_VERSION:-}" ]; then
  # shellcheck disable=SC2296
  eval '_flashrt_root="$(cd "$(dirname "${(%):-%x}")" && pwd)"'
else
  _flashrt_root="$(pwd)"  # POSIX sh: source it from the repository root
fi
export FLASHRT_ROOT="$_flashrt_root"

# prepend DIR to the colon list named VAR unless it is already there
_flashrt_prepend() {
  eval "_flashrt_cur=\"\${$1:-}\""
  case ":${_flashrt_cur}:" in
    *":$2:"*) ;;
    *) if [ -n "$_flashrt_cur" ]; then eval "export $1=\"\$2:\$_flashrt_cur\""; else eval "export $1=\"\$2\""; fi ;;
  esac
}

_flashrt_venv="$_flashrt_root/.venv"
if [ -f "$_flashrt_venv/bin/activate" ]; then
  if [ "${VIRTUAL_ENV:-}" != "$_flashrt_venv" ]; then
    # shellcheck disable=SC1091
    VIRTUAL_ENV_DISABLE_PROMPT="${VIRTUAL_ENV_DISABLE_PROMPT:-1}" . "$_flashrt_venv/bin/activate"
  fi
  _flashrt_pyver="3.11"
  for _flashrt_d in "$_flashrt_venv"/lib/python3.*; do
    [ -d "$_flashrt_d" ] && _flashrt_pyver="${_flashrt_d##*/python}"
  done
  _flashrt_site="$_flashrt_venv/lib/python${_flashrt_pyver}/site-packages"

  # Quirk 1: ros_wheels_bootstrapper (a .pth file) re-execs every Python process once to set
  # LD_LIBRARY_PATH. Set that path here and mark the bootstrap done: one exec, same libraries.
  for _flashrt_d in "$_flashrt_site"/ros_*.libs; do
    [ -d "$_flashrt_d" ] && _flashrt_prepend LD_LIBRARY_PATH "$_flashrt_d"
  done
  _flashrt_prepend LD_LIBRARY_PATH "$_flashrt_venv/lib"
  export _ROS_WHEELS_BOOTSTRAP_COMPLETE=1

  # Quirk 2: the venv is the ament/CMake prefix of the ROS wheels.
  _flashrt_prepend AMENT_PREFIX_PATH "$_flashrt_venv"
  _flashrt_prepend CMAKE_PREFIX_PATH "$_flashrt_venv"

  # Quirk 3: rosidl_generator_py exports the numpy include dir in the interface of the generated
  # Python typesupport target; CMake refuses that when it lies in the source tree (.venv is inside
  # the checkout). Give CMake a path outside it: a symlink in a per-checkout cache directory,
  # passed as -DPython3_NumPy_INCLUDE_DIR (Makefile, and COLCON_DEFAULTS_FILE for a bare
  # `colcon build` in this shell).
  _flashrt_sum="$(printf '%s' "$_flashrt_root" | cksum | cut -d' ' -f1)"
  _flashrt_cache="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/flashrt_ros/ws-${_flashrt_sum}"
  _flashrt_npinc="$(cd "$_flashrt_site/numpy/_core/include" 2>/dev/null && pwd)"
  if [ -n "$_flashrt_npinc" ]; then
    if [ "$(readlink "$_flashrt_cache/numpy_include" 2>/dev/null)" != "$_flashrt_npinc" ]; then
      if ! { mkdir -p "$_flashrt_cache" && ln -sfn "$_flashrt_npinc" "$_flashrt_cache/numpy_include"; } 2>/dev/null; then
        _flashrt_cache="${TMPDIR:-/tmp}/flashrt_ros-$(id -u)/ws-${_flashrt_sum}"
        mkdir -p "$_flashrt_cache" && ln -sfn "$_flashrt_npinc" "$_flashrt_cache/numpy_include"
      fi
    fi
    export FLASHRT_NUMPY_INCLUDE="$_flashrt_cache/numpy_include"
    if [ ! -f "$_flashrt_cache/colcon-defaults.yaml" ]; then
      printf 'build:\n  symlink-install: true\n  cmake-args:\n    - -DPython3_EXECUTABLE=%s\n    - -DPython3_NumPy_INCLUDE_DIR=%s\n' \
        "$_flashrt_venv/bin/python" "$FLASHRT_NUMPY_INCLUDE" > "$_flashrt_cache/colcon-defaults.yaml"
    fi
    export COLCON_DEFAULTS_FILE="$_flashrt_cache/colcon-defaults.yaml"
  fi

  # Quirk 4: the wheels' CMake exports (share/*/cmake/*Export.cmake) name include directories of
  # the machine that built them, /opt/python/cp311-cp311/include/python3.11 and its numpy include,
  # which do not exist here; CMake refuses imported targets with missing include dirs. Rewrite
  # those paths in the venv's copies to this interpreter's (idempotent; only when missing here).
  if [ ! -e /opt/python/cp311-cp311/include ] && \
     grep -rlq --include='*.cmake' '/opt/python/cp' "$_flashrt_venv/share" 2>/dev/null; then
    _flashrt_inc="$("$_flashrt_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)"
    _flashrt_npinc="$("$_flashrt_venv/bin/python" -c 'import numpy; print(numpy.get_include())' 2>/dev/null)"
    if [ -n "$_flashrt_inc" ] && [ -n "$_flashrt_npinc" ]; then
      grep -rl --include='*.cmake' '/opt/python/cp' "$_flashrt_venv/share" 2>/dev/null | \
        while IFS= read -r _flashrt_f; do
          sed -i -E \
            -e "s#/opt/python/cp[0-9]+-cp[0-9]+/lib/python[0-9.]+/site-packages/numpy/_core/include#${_flashrt_npinc}#g" \
            -e "s#/opt/python/cp[0-9]+-cp[0-9]+/include/python[0-9.]+#${_flashrt_inc}#g" \
            "$_flashrt_f"
        done
    fi
  fi
fi

# The colcon workspace (install/ of `make setup`): generated flashrt_ros.msg/.srv, the installed
# package (symlinks into flashrt_ros/), executables in lib/flashrt_ros.
_flashrt_ws="$_flashrt_root/install"
if [ -f "$_flashrt_ws/local_setup.bash" ] && [ -n "${BASH_VERSION:-}" ]; then
  # shellcheck disable=SC1091
  . "$_flashrt_ws/local_setup.bash"
elif [ -f "$_flashrt_ws/local_setup.sh" ]; then
  # shellcheck disable=SC1091
  COLCON_CURRENT_PREFIX="$_flashrt_ws" . "$_flashrt_ws/local_setup.sh"
fi
if [ -d "$_flashrt_ws/flashrt_ros" ]; then
  _flashrt_pkg="$_flashrt_ws/flashrt_ros"
  _flashrt_prepend AMENT_PREFIX_PATH "$_flashrt_pkg"
  _flashrt_prepend CMAKE_PREFIX_PATH "$_flashrt_pkg"
  _flashrt_prepend LD_LIBRARY_PATH "$_flashrt_pkg/lib"
  for _flashrt_d in "$_flashrt_pkg"/lib/python3.*/site-packages; do
    [ -d "$_flashrt_d" ] && _flashrt_prepend PYTHONPATH "$_flashrt_d"
  done
  # flashrt_node, flashrt-replay, flashrt-bagdiff, flashrt_sim_arm on PATH
  _flashrt_prepend PATH "$_flashrt_pkg/lib/flashrt_ros"
fi

# --- DDS stays on this machine (docs/design.md, "Environment")
export RMW_IMPLEMENTATION=rmw_fastrtps_cpp
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
# static peers are contacted whatever the discovery range (only OFF disables them): none here
unset ROS_STATIC_PEERS
unset ROS_LOCALHOST_ONLY  # deprecated; conflicts with ROS_AUTOMATIC_DISCOVERY_RANGE
if [ -z "${ROS_DOMAIN_ID:-}" ]; then
  # a stable id in 1..100 from the checkout path (tests use 101..200, one per test)
  _flashrt_sum="$(printf '%s' "$_flashrt_root" | cksum | cut -d' ' -f1)"
  export ROS_DOMAIN_ID="$((_flashrt_sum % 100 + 1))"
fi
export ROS_DOMAIN_ID

unset _flashrt_cur _flashrt_d _flashrt_f _flashrt_inc _flashrt_npinc _flashrt_pkg _flashrt_pyver \
  _flashrt_site _flashrt_sum _flashrt_venv _flashrt_ws _flashrt_cache
unset -f _flashrt_prepend
case "$_flashrt_opts" in *u*) set -u ;; esac
case "$_flashrt_opts" in *e*) set -e ;; esac
unset _flashrt_opts _flashrt_root _flashrt_src
