# Two commands do everything on a fresh machine:
#   make demo   installs what it needs and runs the quick start on the bundled digits dataset
#   make test   installs what it needs and runs the whole test suite (what CI runs)
# Both set up their own virtual environment in $(VENV).

PYTHON ?= python3
VENV ?= .venv
# The torch used in development and CI. `torch==2.13.0` is the CPU build only where pip finds one
# (the development machine's local wheels hold torch-2.13.0+cpu); from PyPI, Linux wheels are CUDA builds,
# and the CPU build needs PyTorch's index: install it first (python -m venv .venv; .venv/bin/pip install
# torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu), then `make install` keeps it.
# Users may set TORCH_SPEC to their own build, e.g. `make demo TORCH_SPEC=torch`; the library needs torch>=2.2.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-ray-isolated install lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/decentdp run experiments/demo.toml

test: $(STAMP)
	$(BIN)/python -m pytest

# The Ray tests (also part of `make test`) inside a network namespace holding only the loopback
# interface: they pass without any other network (Linux; needs unprivileged user namespaces or root).
test-ray-isolated: $(STAMP)
	unshare -rn sh -c 'ip link set lo up && $(BIN)/python -m pytest -m ray'

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis
