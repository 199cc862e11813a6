"""draftflow core: recipes, storage, extraction, drafters, training and evaluation.

Nothing in this package imports Prefect; `tasks/` and `flows/` wrap it.
"""

__version__ = "0.2.0"
