"""Prefect flows: wiring only. Each flow calls tasks from `tasks/`, which call the core."""
