# Two commands do everything on a fresh machine:
#   make demo   installs what it needs and runs the quick start on the bundled digits dataset
#   make test   installs what it needs and runs the whole test suite (what CI runs)
# Both set up their own virtual environment in $(VENV).

PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch used in development and CI. Users with a GPU may set TORCH_SPEC to
# their own build, e.g. `make demo TORCH_SPEC=torch`; the library itself needs torch>=2.2.
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
