# The two commands of the README: `make demo` and `make test`. Each builds its own virtual
# environment in .venv (torch pinned by constraints.txt to the CPU build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: demo test lint unit crd clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.engine: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[engine]'
	touch $@

$(VENV)/.dev: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[engine,dev]'
	touch $@ $(VENV)/.engine

## Brook's main job on its built-in default: validate the example manifests, then render
## the engine configuration the SmolLM2 example's pods get.
demo: $(VENV)/.engine
	$(BIN)/brook validate -f crds/examples/
	$(BIN)/brook render -f crds/examples/smollm2-cpu.yaml

## Lint, type-check, dependency rules, then every test.
test: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest

## Regenerate crds/llminference.yaml and docs/crd-reference.md from the API models.
crd: $(VENV)/.engine
	$(BIN)/brook crd > crds/llminference.yaml
	$(BIN)/brook crd --reference > docs/crd-reference.md

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .import_linter_cache
