"""Prefect tasks: thin `@task` wrappers over the draftflow core. They pass URIs and ids, never tensors."""
