# The two commands: `make demo` and `make test`. Both bootstrap first (idempotent, seconds
# when everything is already there).
SHELL := /bin/bash
PYTEST_ARGS ?=
DEMO_RECIPE ?= recipes/smollm2-135m-dflash-cpu-demo.yaml

.PHONY: bootstrap demo lint docs docs-build test test-fast test-faults test-recipes bench bench-quality bench-race

bootstrap:
	@scripts/bootstrap.sh

# Embedded (ephemeral) Prefect: no server to run first; offline hosts skip analytics.
demo: bootstrap
	PREFECT_SERVER_ANALYTICS_ENABLED=false .venv/bin/draftflow demo $(DEMO_RECIPE)

# ruff (rules and line length in pyproject.toml): formatting and lint errors fail the tests.
lint: bootstrap
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .

# The docs site (mkdocs.yml, pages under docs/): `make docs` serves it at http://127.0.0.1:8000;
# `make test` builds it with --strict (a broken link or anchor fails). The recipe and command
# references under docs/reference are generated: scripts/gen_reference.py (a test fails when stale).
export NO_MKDOCS_2_WARNING := 1
docs: bootstrap
	.venv/bin/mkdocs serve
docs-build: bootstrap
	.venv/bin/mkdocs build --strict --quiet --site-dir .site

# The fast tests first (no server, no long training: a broken import fails in two minutes), then
# the slow ones; scripts/suite_budget.py then fails a fast test over 5 s or any test over 120 s
# without @pytest.mark.slow_ok(reason=...), and prints the slowest and the server start-ups.
REPORTS := .pytest-report
test: bootstrap lint docs-build
	.venv/bin/python -m pytest -m "not slow" --suite-report=$(REPORTS)/fast.json $(PYTEST_ARGS)
	.venv/bin/python -m pytest -m slow --suite-report=$(REPORTS)/slow.json $(PYTEST_ARGS)
	.venv/bin/python scripts/suite_budget.py $(REPORTS)/fast.json $(REPORTS)/slow.json

# No vLLM, Prefect or S3 server and no torchrun: tests/suite_plugin.py fails a test here that starts one.
test-fast: bootstrap
	.venv/bin/python -m pytest -m "not slow" --suite-report=$(REPORTS)/fast.json $(PYTEST_ARGS)
	.venv/bin/python scripts/suite_budget.py $(REPORTS)/fast.json

# The kill series behind docs/reliability.md: the suite's one-kill fault tests, each run as its
# whole series (tests/fault_series.py); prints the table rows.
test-faults: bootstrap
	.venv/bin/python bench/faults.py

# Every shipped recipe end to end on the CPU stack (the suite runs the quickstart's one).
test-recipes: bootstrap
	DRAFTFLOW_SHIPPED_RECIPES=all .venv/bin/python -m pytest tests/test_shipped_recipes_e2e.py $(PYTEST_ARGS)

# Benchmarks print ratios against a baseline measured in the same run (see README).
bench: bootstrap
	.venv/bin/python bench/extraction.py
	.venv/bin/python bench/train.py
	.venv/bin/python bench/peer_train.py

# Does the drafter pay? The quality recipe end to end (33-54 min on a 2-core CPU: docs/benchmarks.md),
# then τ per category and decode speed with and without the drafter in vLLM (3 rounds). ABLATION=1
# runs the demo recipe instead, and the same budget on chitchat/chatterbot data beside it.
bench-quality: bootstrap
	.venv/bin/python bench/quality.py --speed-rounds 3 $(if $(ABLATION),--recipe recipes/smollm2-135m-dflash-cpu-demo.yaml --ablation)

# What users would otherwise pick: the target alone, vLLM's n-gram (tuned on draftflow-tune) and
# suffix decoding, the quality and demo recipes' drafters, on every draftflow-eval prompt, at batch 1
# and 4 requests at once, 3 interleaved rounds (docs/benchmarks.md). Trains both drafters first;
# DRAFTERS="--drafter quality=RUN/export ..." races exports already trained.
bench-race:
	@scripts/bootstrap.sh --with-suffix
	.venv/bin/python bench/race.py $(DRAFTERS)

