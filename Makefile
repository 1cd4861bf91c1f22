# BRAIxDet for Detectron2. The README's two commands are `make demo` and `make test`;
# both create or reuse the virtual environment below (a no-op when up to date).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.braixdet-setup
SETUP_INPUTS := requirements.txt setup.cfg setup.py pyproject.toml tools/install_detectron2.py \
                tools/patches/detectron2-0.6-backports.patch
OUT ?= out
QUICK ?=
RESUME ?=
SEEDS ?=
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench clean-venv

setup: $(STAMP)

$(STAMP): $(SETUP_INPUTS)
	@echo "[setup] creating/updating $(VENV) (Python 3.11, torch 2.14.1, detectron2 0.6 + backports)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -r requirements.txt
	$(PY) tools/install_detectron2.py
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

demo: $(STAMP)
	$(PY) tools/run_demo.py --out $(OUT) $(if $(QUICK),--quick,) $(if $(RESUME),--resume,) \
		$(if $(SEEDS),--seeds $(SEEDS),)

test: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest tests -n 2 --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check projects tools tests benchmarks

bench: $(STAMP)
	for b in benchmarks/benchmark_*.py; do $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
