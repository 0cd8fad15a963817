# The README's two commands (run, test); both set the machine up first (idempotent).
OUT ?= runs/local
CONFIG ?= configs/local.yaml
PYTEST_ARGS ?=

.PHONY: setup run test test-fast lint
setup:
	./scripts/setup.sh

run: setup
	.venv/bin/python -m tide.launch --config $(CONFIG) --out $(OUT)

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest $(PYTEST_ARGS)

# Unit tests only: no vLLM start-up, no Slurm cluster (a few minutes).
test-fast: setup
	.venv/bin/python -m pytest -m "not vllm and not slurm" $(PYTEST_ARGS)

lint: setup
	.venv/bin/ruff check .
