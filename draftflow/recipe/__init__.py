"""Recipes: the YAML a user forks, its schema, checks and fingerprint."""

from draftflow.recipe.checks import Validated, resolve_context_layer_ids, resolve_layer_ids, validate
from draftflow.recipe.fingerprint import fingerprint
from draftflow.recipe.load import RecipeError, expand, load_recipe, recipe_from_dict
from draftflow.recipe.schema import Recipe

__all__ = [
    "Recipe",
    "RecipeError",
    "Validated",
    "expand",
    "fingerprint",
    "load_recipe",
    "recipe_from_dict",
    "resolve_context_layer_ids",
    "resolve_layer_ids",
    "validate",
]
