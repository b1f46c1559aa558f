# Two entry points (see README): `make run` runs the main job, `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine; `make test` also the system packages.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SYSTEM := $(VENV)/.system-packages
# The environment's interpreter: one every user may run. Each job's workers run as a user of their
# own (docs/deploy.md), and cannot start a Python under a home folder closed to others (pyenv's in
# /root): the system's Python 3.11+ when there is one.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3.1[1-9] /usr/local/bin/python3.1[1-9]) python3)

.PHONY: install system-packages run test check bench clean

$(STAMP): pyproject.toml train/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# The training library (its own package, what a job's image installs), then the scheduler on it.
	$(PY) -m pip install --quiet -e ./train
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# What the tests need beyond Python, from Debian when we are root: runc makes each real job's box
# (without it the node agents refuse to run jobs' code; --box off runs them unboxed, as you), and
# the dashboard's browser test drives Chromium through its chromedriver (without them that one test
# is skipped, and says why). `make run` needs neither: its jobs are simulated.
$(SYSTEM): | $(STAMP)
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] && command -v runc >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing runc, chromium and chromium-driver (apt-get): the jobs' boxes, the dashboard's browser test"; \
		{ DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runc chromium chromium-driver; } >/dev/null \
		|| echo "could not install runc and chromium: real jobs' tests will fail closed, the browser test skip"; \
	else \
		echo "no runc or chromium and no root apt-get to install them: real jobs need --box off, the dashboard's browser test will be skipped"; \
	fi
	touch $(SYSTEM)

system-packages: $(SYSTEM)

# The main job on the embedded default: NATS and the six services, the built-in workload replayed
# through them on sia-hetero-64 with simulated executors; no reference data, no Docker.
run: $(STAMP)
	$(VENV)/bin/goodput up --once --out out/up.json

# Two workers, a test file each at a time (most tests wait on processes and the bus, not on a core);
# the slowest tests are listed at the end: what to look at when the suite grows past its 15 minutes.
test: $(STAMP) $(SYSTEM)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# The quick loop before a commit: lint, format, and the tests that start no process; CI runs everything (`make test`).
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 -m "not e2e"

bench: $(STAMP)
	$(PY) benchmarks/bench_models.py
	$(PY) benchmarks/bench_sia_ilp.py
	$(PY) benchmarks/bench_ingest.py
	$(PY) benchmarks/bench_bus.py --zoo --workload examples/workloads/mixed-40.csv
	$(PY) benchmarks/bench_load.py
	$(PY) benchmarks/bench_burst.py
	$(PY) benchmarks/bench_abuse.py
	$(PY) benchmarks/bench_api.py
	$(PY) benchmarks/bench_trainer_overhead.py
	$(PY) benchmarks/bench_metrics.py
	$(PY) benchmarks/bench_decisions.py
	$(PY) benchmarks/bench_simulator.py

clean:
	rm -rf $(VENV) out
