# The two commands of the README: `make serve` and `make test`. Everything lives in .venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: serve test lint docs bench install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Installed once per change of pyproject.toml (a stamp in the venv), so a restart needs no
# network; `make clean` starts over.
install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,docs]'
	touch $@ $(VENV)/.installed

serve: install
	$(BIN)/memproxy serve --config config.yaml --host $(HOST) --port $(PORT)

test: install-dev
	$(BIN)/python -m pytest -q

lint: install-dev
	$(BIN)/ruff check proxy storage policies tests bench
	$(BIN)/ruff format --check proxy storage policies tests bench
	$(BIN)/mypy

# The documentation site into ./site; --strict: a broken link or a page missing from the nav fails.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: install-dev
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) site *.egg-info .pytest_cache .mypy_cache .ruff_cache
