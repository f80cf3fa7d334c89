# sp_lab tasks. `make test` and `make run` install what they need first, so each works on a fresh machine.
#
#   make install   torch unless one is installed (with a GPU torch>=2.11 with CUDA; without one TORCH_CPU_PIN
#                  from pip's default index, the CUDA build on Linux x86_64 unless
#                  TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu), then sp_lab with its hf and dev extras
#   make test      install, then the CPU test suite (GPU, multi-GPU and slow tests are deselected on every
#                  machine; make test PYTEST_MARKERS=gpu runs the GPU tests)
#   make run       install, then the headless main job on the embedded default model
#   make lab       JupyterLab on 127.0.0.1 in notebooks/ (token-protected)
#   make lint      ruff

PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The torch to install first on a machine without a GPU. Installing the package alone would let pip
# resolve torch>=2.11 to a CUDA build of several GB. Set TORCH_INDEX_URL to PyTorch's CPU wheel index
# where pip would otherwise fetch that CUDA build.
TORCH_CPU_PIN ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_MARKERS ?= not gpu and not multigpu and not slow
PYTEST_ARGS ?=
# Two pytest-xdist workers: the shared launch of rank checks, the notebook tests beside it and the tests that read
# its results on one, first; every other module, whole, on whichever worker is free (tests/conftest.py orders and
# groups them). In one process the in-process compiles after the launch ran on one core of two: two workers keep
# both busy. PYTEST_WORKERS=0 runs the session in one process.
PYTEST_WORKERS ?= 2
# The suite checks numerics, graphs and op counts, not how fast CPU kernels run: it has ATen and Inductor use plain
# C++ (ATEN_CPU_CAPABILITY=default) rather than AVX2/AVX-512 code, which Inductor generates and g++ compiles faster
# (benchmarks/bench_suite_compile.py, cold rank checks on 2 cores, torch 2.13.0+cpu, 2026-12-05, plain / native
# per pair: test_compiler_backend 0.92 and 0.84; test_token_dim, which compiles fewer kernels, 0.92, 0.87 and 1.01).
# TEST_CPU_CAPABILITY= keeps the machine's own vector instructions.
TEST_CPU_CAPABILITY ?= default
LAB_PORT ?= 8888
# Jupyter refuses to start as root (e.g. in a container) unless told to; pass the flag only then.
LAB_ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# Inductor keys neither its cache nor its precompiled C++ headers (under $TMPDIR/torchinductor_<user>, wherever
# TORCHINDUCTOR_CACHE_DIR points) on the CPU capability: kernel source generated for the machine's vector ISA and
# then built by a process with ATEN_CPU_CAPABILITY=default fails ("'at::vec' has not been declared"). So each
# capability has a cache and a temporary directory of its own, and every process a target starts (pytest, launch()
# ranks, notebook kernels) inherits its target's: `make test` (TEST_CPU_CAPABILITY) never reads what `make run` or
# `make lab` (the machine's own) built, in any order. Within one capability, a kernel compiled once is loaded from
# the cache afterwards (docs/compile-time.md has measured compile times).
INDUCTOR_CACHE_ROOT ?= $(CURDIR)/.cache
CPU_TMP_ROOT ?= $(or $(TMPDIR),/tmp)
# $(call cpu_env,CAPABILITY): the environment of processes running with ATen's CPU capability CAPABILITY (empty:
# the machine's own, unless ATEN_CPU_CAPABILITY is set already). TMPDIR must exist, or Python falls back to /tmp.
cpu_label = $(or $(1),$(ATEN_CPU_CAPABILITY),native)
cpu_env = mkdir -p $(CPU_TMP_ROOT)/sp_lab-cpu-$(cpu_label) && $(if $(1),ATEN_CPU_CAPABILITY=$(1)) \
	TORCHINDUCTOR_CACHE_DIR=$(INDUCTOR_CACHE_ROOT)/inductor-$(cpu_label) TMPDIR=$(CPU_TMP_ROOT)/sp_lab-cpu-$(cpu_label)

# One stamp per Python environment, redone when pyproject.toml changes.
STAMP := .cache/install-$(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])").stamp

.PHONY: install test run lab lint

install:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') already installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing torch with CUDA"; $(PIP) install "torch>=2.11"; \
	else \
		echo "no GPU: installing $(TORCH_CPU_PIN)"; \
		$(PIP) install "$(TORCH_CPU_PIN)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)); \
	fi
	$(PIP) install -e ".[hf,dev]"
	@mkdir -p .cache && touch $(STAMP)

$(STAMP): pyproject.toml
	$(MAKE) install

test: $(STAMP)
	@# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
	@$(call cpu_env,$(TEST_CPU_CAPABILITY)) $(PYTHON) -m pytest -q -m "$(PYTEST_MARKERS)" -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

run: $(STAMP)
	$(call cpu_env,) $(PYTHON) -m sp_lab run

lab: $(STAMP)
	@# Listens on 127.0.0.1 only; Jupyter prints the URL with its random token (or set LAB_TOKEN).
	$(call cpu_env,) $(PYTHON) -m jupyter lab --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
		--ServerApp.root_dir=notebooks $(LAB_ALLOW_ROOT) $(if $(LAB_TOKEN),--IdentityProvider.token=$(LAB_TOKEN))

lint:
	$(PYTHON) -m ruff check sp_lab tests benchmarks
