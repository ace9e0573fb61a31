#!/usr/bin/env bash
# End-to-end ROS 2 benchmark on the GPU machine (no ROS, no network there):
#   bash bench/ros_gpu.sh OUT_DIR [ros_bench.py args...]
# from the repository root, with the cp312 ROS wheels in .whl312/ (carried): make them on the
# development machine with `bash bench/fetch_whl312.sh` (derived from .venv, then checked).
#  1. .venv: a venv of python3 (the one with torch) that also sees that interpreter's packages,
#     with .whl312/*.whl installed offline (skipped when already done on a warm machine);
#  2. the colcon build of flashrt_ros into install/, as `make build` does (skipped when done);
#  3. bench/ros_bench.py --device cuda --out OUT_DIR/ros.json (node and floor logs in
#     OUT_DIR/ros_logs.tgz): cold and warm start, timer rates (1 kHz for 60 s), services, lockstep,
#     and the bare-rclpy floors (bench/ros_floors.py); about 4-5 minutes on the H200.
# Env: PYTHON (python3), WHEELS (.whl312), DEVICE (cuda), GATE_LOOP_S (unset: no gate; e.g.
# 0.85: exit 3 before the setup when bench/host_gate.py's loop is slower, a host too slow to
# judge the node on), GATE_SLEEP_P99_US (the same for its 1 ms sleeps' p99 lateness, e.g. 110).
# DDS stays on loopback (env.sh).
set -eo pipefail

OUT="${1:?usage: bash bench/ros_gpu.sh OUT_DIR [ros_bench.py args]}"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl312}"
DEVICE="${DEVICE:-cuda}"
VENV="$ROOT/.venv"
T0=$(date +%s%N)

say() { local t=$(( ($(date +%s%N) - T0) / 100000000 )); printf '[ros_gpu %4d.%ds] %s\n' $((t / 10)) $((t % 10)) "$*"; }
die() { printf '[ros_gpu] FAILED: %s\n' "$*" >&2; exit 1; }

# ---- 0. what the machine has
command -v "$PY" >/dev/null || die "no $PY"
# with GATE_LOOP_S or GATE_SLEEP_P99_US, a slow host stops the call here, before the setup (exit 3; bench/host_gate.py)
if [ -n "${GATE_LOOP_S:-}${GATE_SLEEP_P99_US:-}" ]; then
  grc=0; rm -f "$OUT/host_gate.json"
  "$PY" bench/host_gate.py --max-loop-s "${GATE_LOOP_S:-0}" --max-sleep-p99-us "${GATE_SLEEP_P99_US:-0}" \
    --out "$OUT/host_gate.json" >/dev/null || grc=$?
  [ -f "$OUT/host_gate.json" ] || die "bench/host_gate.py failed (rc $grc)"
  say "host gate: $(tr -d ' \n' < "$OUT/host_gate.json")"
  [ "$grc" = 0 ] || { say "slow host (GATE_LOOP_S=${GATE_LOOP_S:-} GATE_SLEEP_P99_US=${GATE_SLEEP_P99_US:-}): not run"; exit "$grc"; }
fi
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' 2>/dev/null ||
  say "warning: $PY is $("$PY" -V 2>&1), the wheels in $WHEELS are for CPython 3.12"
"$PY" -c 'import numpy, torch' || die "$PY cannot import numpy and torch"
for tool in cmake gcc g++; do command -v $tool >/dev/null || die "no $tool on PATH"; done
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  die "no wheels in $WHEELS: run 'bash bench/fetch_whl312.sh' on the development machine (it derives the cp312 wheel set from .venv and checks it), then carry $WHEELS"
fi
say "python $("$PY" -V 2>&1 | cut -d' ' -f2), torch $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available())'), $(cmake --version | head -1), gcc $(gcc -dumpversion), $(ls "$WHEELS"/*.whl | wc -l) wheels"

# ---- 1. venv with the wheels
STAMP="$VENV/.whl312.installed"
want="$(ls "$WHEELS"/*.whl | xargs -n1 basename | md5sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  say "venv up to date ($VENV)"
else
  rm -rf "$VENV"
  say "creating $VENV"
  "$PY" -m venv --system-site-packages --without-pip "$VENV" || die "python3 -m venv failed"
  # --system-site-packages reaches the *base* interpreter's packages; when python3 is itself a
  # venv (/opt/torch/.venv), add its site-packages too (after the venv's own: ours win).
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$PY" - "$site" <<'EOF'
import site, sys
dirs = [p for p in site.getsitepackages() if p != sys.argv[1]]
with open(f"{sys.argv[1]}/_flashrt_parent_site.pth", "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF
  "$VENV/bin/python" -c 'import torch, numpy, pip' || die "the venv does not see torch/numpy/pip"
  touch "$VENV/COLCON_IGNORE" "$VENV/local_setup.sh"
  say "installing $(ls "$WHEELS"/*.whl | wc -l) wheels offline"
  _ROS_WHEELS_BOOTSTRAP_COMPLETE=1 "$VENV/bin/python" -m pip install -q --no-index --no-deps --ignore-installed \
    --no-cache-dir --disable-pip-version-check "$WHEELS"/*.whl || die "pip install of $WHEELS failed"
  echo "$want" > "$STAMP"
  rm -f build/.flashrt_build_key
  say "wheels installed"
fi

# ---- 2. environment (env.sh: venv, quirks, LOCALHOST discovery) and the colcon build
# shellcheck disable=SC1091
. ./env.sh
# numpy lives outside .venv (the image's): env.sh finds no numpy include in the venv, give it.
export FLASHRT_NUMPY_INCLUDE="$("$VENV/bin/python" -c 'import numpy; print(numpy.get_include())')"
[ "$VIRTUAL_ENV" = "$VENV" ] || die "env.sh did not activate $VENV"
python -c 'import rclpy, colcon_core, catkin_pkg, em, lark, argcomplete' || die "the venv lacks a ROS package"
command -v colcon >/dev/null || die "no colcon in $VENV/bin"

key="$( { find flashrt_ros scripts launch config msg srv -type f ! -path '*/__pycache__/*' ! -name '*.py[co]' | LC_ALL=C sort; \
          cat package.xml CMakeLists.txt msg/*.msg srv/*.srv "$STAMP"; } | md5sum | cut -d' ' -f1 )"
if [ -f install/flashrt_ros/share/flashrt_ros/package.xml ] && [ "$(cat build/.flashrt_build_key 2>/dev/null)" = "$key" ]; then
  say "colcon build up to date"
else
  gen=()
  if ! command -v make >/dev/null && command -v ninja >/dev/null; then gen=(-G Ninja); fi
  say "colcon build --symlink-install ${gen[*]}"
  rm -rf build/flashrt_ros install log
  colcon build --symlink-install --base-paths . --packages-select flashrt_ros \
    --event-handlers console_cohesion+ summary+ \
    --cmake-args "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
      -DPython3_EXECUTABLE="$VIRTUAL_ENV/bin/python" \
      -DPython3_NumPy_INCLUDE_DIR="$FLASHRT_NUMPY_INCLUDE" > "$OUT/colcon_build.log" 2>&1 || {
    tail -60 "$OUT/colcon_build.log"; die "colcon build failed (log: $OUT/colcon_build.log)"; }
  mkdir -p build && echo "$key" > build/.flashrt_build_key
  find install/flashrt_ros -xtype l -delete
  say "built"
fi
# re-source: the workspace (install/) goes on the paths now that it exists
# shellcheck disable=SC1091
. ./env.sh
[ -x install/flashrt_ros/lib/flashrt_ros/flashrt_node ] || die "no flashrt_node in install/"
python -c 'from flashrt_ros import srv; import rclpy' || die "the built interfaces do not import"
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST  # ros_bench picks its own ROS_DOMAIN_ID per node
unset ROS_STATIC_PEERS  # contacted whatever the discovery range
say "ROS_AUTOMATIC_DISCOVERY_RANGE=$ROS_AUTOMATIC_DISCOVERY_RANGE RMW_IMPLEMENTATION=$RMW_IMPLEMENTATION"

# ---- 3. the benchmark
say "python bench/ros_bench.py --device $DEVICE --out $OUT/ros.json $*"
rc=0
PYTHONUNBUFFERED=1 python bench/ros_bench.py --device "$DEVICE" --out "$OUT/ros.json" \
  --log-dir "$OUT/ros_logs" "$@" || rc=$?
# the node and floor logs as one archive: the device tool brings back a limited number of files
# per call (a 3-round start run writes 13 logs), ros_logs/ is kept with ROS_GPU_KEEP_LOGS=1;
# without the compile cache inductor left there (14 MB of generated code, 2 MB compressed)
if [ -d "$OUT/ros_logs" ] && tar czf "$OUT/ros_logs.tgz" --exclude=ros_logs/compile_cache -C "$OUT" ros_logs; then
  [ "${ROS_GPU_KEEP_LOGS:-0}" = 1 ] || rm -rf "$OUT/ros_logs"
fi
say "done (rc $rc; logs in $OUT/ros_logs.tgz)"
exit $rc
