# One-command entry points. `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; install it first so pip never resolves a
# bare `torch` (a multi-GB CUDA download).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
TORCH ?= torch==2.13.0
# The `zoo` extra (tests/zoo) is installed under a torch constraint so nothing pulls CUDA.
# timm and transformers' ViT import torchvision, whose registry wheel is a CUDA build: it goes
# in with --no-deps (tests/zoo/tv_schemas.py lets it import without its C ops).
TORCHVISION ?= torchvision==0.28.0
# Two cores: BLAS thread pools fighting torch's and each other's cost more than they give
# (eigvalsh for certified spectral norms ran 20x slower multi-threaded).
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1

.PHONY: install serve test test-all lint fast unit bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(FIND_LINKS) $(TORCH)
	echo '$(TORCH)' > $(VENV)/constraints.txt
	$(BIN)/pip install -q $(FIND_LINKS) -c $(VENV)/constraints.txt -e '.[dev,ptb,zoo]'
	$(BIN)/pip install -q --no-deps $(TORCHVISION)
	touch $@

serve: install
	$(BIN)/lsa serve

# ruff (C90: no function above complexity 15), mypy, and the import contracts of pyproject.toml
# (layers, lsa_models pure, no import cycles inside lsa_models).
lint: install
	$(BIN)/ruff check lsa_models api_schemas service tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

# Two tiers (tests/conftest.py gives the markers): `make test` is the lint and the fast tier, a
# few minutes; `make test-all` is every test (the model zoo, servers, headless browser,
# PostgreSQL and Redis, training, the long radius searches) with the property tests at their
# full example counts, what `.ci/run` runs.
FAST_TIER := not slow and not zoo and not postgres and not redis and not browser

fast: install
	$(BIN)/python -m pytest -q -m "$(FAST_TIER)"

unit: fast

test: lint fast

test-all: lint
	LSA_SLOW=1 $(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/attention_speed.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .hypothesis
