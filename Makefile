# Everything starts from a fresh machine with only python3: each target bootstraps .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: bootstrap serve test lint proto compose-check clean

bootstrap: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	@touch $(STAMP)

serve: bootstrap
	$(BIN)/tandem serve $(ARGS)

test: bootstrap
	$(BIN)/python -m pytest -q $(ARGS)

lint: bootstrap
	$(BIN)/ruff check .
	$(BIN)/mypy proto rpc scheduler postproc_worker gpu_worker

# Regenerate the gRPC stubs from proto/generation.proto (tests check they match).
proto: bootstrap
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
		proto/generation.proto

clean:
	rm -rf $(VENV) build *.egg-info
