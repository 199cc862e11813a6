# The two commands: `make demo` and `make test`. Both bootstrap first (idempotent, seconds
# when everything is already there).
SHELL := /bin/bash
PYTEST_ARGS ?=
DEMO_RECIPE ?= recipes/smollm2-135m-dflash-cpu-demo.yaml

.PHONY: bootstrap demo lint test test-fast bench bench-quality

bootstrap:
	@scripts/bootstrap.sh

# Embedded (ephemeral) Prefect: no server to run first; offline hosts skip analytics.
demo: bootstrap
	PREFECT_SERVER_ANALYTICS_ENABLED=false .venv/bin/draftflow demo $(DEMO_RECIPE)

# ruff (rules and line length in pyproject.toml): formatting and lint errors fail the tests.
lint: bootstrap
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .

test: bootstrap lint
	.venv/bin/python -m pytest $(PYTEST_ARGS)

test-fast: bootstrap
	.venv/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

# Benchmarks print ratios against a baseline measured in the same run (see README).
bench: bootstrap
	.venv/bin/python bench/extraction.py
	.venv/bin/python bench/train.py
	.venv/bin/python bench/peer_train.py

# Does the drafter pay? The quality recipe end to end (~37 min on 2-core host B, 54 on host C: README),
# then τ per category and decode speed with and without the drafter in vLLM (3 rounds). ABLATION=1
# runs the demo recipe instead, and the same budget on chitchat/chatterbot data beside it.
bench-quality: bootstrap
	.venv/bin/python bench/quality.py --speed-rounds 3 $(if $(ABLATION),--recipe recipes/smollm2-135m-dflash-cpu-demo.yaml --ablation)
