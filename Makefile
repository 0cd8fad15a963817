# The two commands of the README. Both set the machine up first (idempotent).
OUT ?= runs/local
CONFIG ?= configs/local.yaml
PYTEST_ARGS ?=

.PHONY: setup run test
setup:
	./scripts/setup.sh

run: setup
	.venv/bin/python -m tide.launch --config $(CONFIG) --out $(OUT)

test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS)
