# Two entry points (see README): `make run` runs the main job, `make test` runs the tests.
# Both create .venv and install everything on a fresh machine.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
REFERENCE ?= ../shared/reference

.PHONY: install run test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/goodput models report --reference $(REFERENCE)/sia --out out/models-report.json

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_models.py

clean:
	rm -rf $(VENV) out
