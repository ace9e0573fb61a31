# flashrt_ros commands (docs/design.md, "Commands"). Every target that runs Python sources env.sh,
# which keeps DDS on loopback.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON ?= python3.11
VENV := .venv
REQ_STAMP := $(VENV)/.requirements.installed
BUILD_KEY := build/.flashrt_build_key
LINT_PATHS := flashrt_ros test bench tools launch setup.py
ENV := . ./env.sh
# --durations: each run's slowest tests at the end of its output (where a slow CI went)
PYTEST_ARGS ?= --timeout=900 --durations=20

.PHONY: setup venv build test demo lint format bench clean distclean

## setup: venv with the pinned requirements (only when requirements.txt changed), then the colcon
## build (only when the file set, package.xml, CMakeLists.txt, msg/ or srv/ changed; Python files
## are symlinked into install/, so their edits are live without a rebuild).
setup: venv build

venv:
	@if [ ! -x $(VENV)/bin/python ]; then \
	  echo "setup: creating $(VENV) with $(PYTHON)"; \
	  $(PYTHON) -m venv $(VENV); \
	fi
	@touch $(VENV)/COLCON_IGNORE $(VENV)/local_setup.sh
	@if ! cmp -s requirements.txt $(REQ_STAMP); then \
	  echo "setup: installing requirements.txt into $(VENV)"; \
	  _ROS_WHEELS_BOOTSTRAP_COMPLETE=1 $(VENV)/bin/python -m pip install -q -r requirements.txt 2>&1 | { grep -v "WARNING: Location .* is ignored" || true; }; \
	  cp requirements.txt $(REQ_STAMP); \
	  rm -f $(BUILD_KEY); \
	else \
	  echo "setup: requirements up to date"; \
	fi

build: venv
	@$(ENV); \
	key="$$( { find flashrt_ros scripts launch config msg srv -type f ! -path '*/__pycache__/*' ! -name '*.py[co]' | LC_ALL=C sort; \
	          cat package.xml CMakeLists.txt msg/*.msg srv/*.srv $(REQ_STAMP); } | md5sum | cut -d' ' -f1 )"; \
	if [ -f install/flashrt_ros/share/flashrt_ros/package.xml ] && [ "$$(cat $(BUILD_KEY) 2>/dev/null)" = "$$key" ]; then \
	  echo "setup: colcon build up to date"; \
	else \
	  echo "setup: colcon build --symlink-install"; \
	  colcon build --symlink-install --base-paths . --packages-select flashrt_ros \
	    --event-handlers console_cohesion- summary+ \
	    --cmake-args -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF -DPython3_EXECUTABLE="$$VIRTUAL_ENV/bin/python" \
	      -DPython3_NumPy_INCLUDE_DIR="$$FLASHRT_NUMPY_INCLUDE"; \
	  mkdir -p build && echo "$$key" > $(BUILD_KEY); \
	fi; \
	if [ -d install/flashrt_ros ]; then find install/flashrt_ros -xtype l -delete; fi  # removed sources

## test: the suite as two pytest runs at once (test/run_suite.py says how): the tests marked
## `exclusive` (their verdict rests on timing) one at a time at normal priority, all others on
## TEST_WORKERS pytest-xdist processes under SCHED_IDLE.
TEST_WORKERS ?= 2
test: setup
	@$(ENV); python test/run_suite.py --workers $(TEST_WORKERS) $(PYTEST_ARGS)

## demo: POLICY=builtin:act runs the same story with the visuomotor policy on the sim's camera.
POLICY ?= builtin:hybrid
# make bench: a folder of its own (bench/results is merged by hand, bench/README.md)
BENCH_OUT ?= out/bench
demo: setup
	@$(ENV); python -m flashrt_ros.demo --policy '$(POLICY)'

lint: venv
	@$(ENV); ruff check $(LINT_PATHS) && ruff format --check $(LINT_PATHS)

format: venv
	@$(ENV); ruff check --fix $(LINT_PATHS); ruff format $(LINT_PATHS)

## bench: GPU machine only (Python 3.12, torch with CUDA, no ROS): uses .venv when present.
bench:
	@if [ -f $(VENV)/bin/activate ]; then $(ENV); fi; \
	PY="$$(command -v python || command -v python3)"; "$$PY" bench/run_all.py --out $(BENCH_OUT)

clean:
	rm -rf build install log .pytest_cache .ruff_cache
	find flashrt_ros test -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
