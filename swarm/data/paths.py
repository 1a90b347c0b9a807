"""Where a recipe's local files are read: inside the peer's data directory, never elsewhere. A recipe is published
by whoever runs the bootstrap, so it may not make a volunteer's peer read files it chose (`~` would be their home
directory)."""

from __future__ import annotations

from pathlib import Path

from swarm.config import DataRecipe, ModelRecipe, Recipe, RecipeError


def local_path(field: str, value: str, data_dir: str | Path) -> Path:
    """The local file a recipe's `field` names (`value`, relative to `data_dir` or absolute inside it). A recipe is
    published by whoever runs the bootstrap, so it may not make a volunteer's peer read files elsewhere (`~` would
    be their home directory): RecipeError, naming the field and what to do, for a path outside `data_dir` (after
    following symlinks)."""
    root = Path(data_dir).expanduser().resolve()
    path = Path(value)
    resolved = (path if path.is_absolute() else root / path).resolve()
    if not resolved.is_relative_to(root):
        raise RecipeError(f"recipe field {field} names {value!r}, outside this peer's data directory {root}: copy "
                          f"the files into it (and name them relative to it), or pass --data-dir")
    return resolved


def local_files(recipe: "Recipe", data_dir: str | Path) -> tuple[str, str, "ModelRecipe"]:
    """(data.source, data.tokenizer, the model recipe) with each local path the recipe names resolved inside
    `data_dir` (see local_path); the bundled corpus, the trained BPE and a config-less model name no file."""
    source, tokenizer, model = recipe.data.source, recipe.data.tokenizer, recipe.model
    if source != DataRecipe.model_fields["source"].default:
        source = str(local_path("data.source", source, data_dir))
    if tokenizer != DataRecipe.model_fields["tokenizer"].default:
        tokenizer = str(local_path("data.tokenizer", tokenizer, data_dir))
    if model.config_file is not None:
        model = model.model_copy(update={"config_file": str(local_path("model.config_file", model.config_file,
                                                                             data_dir))})
    return source, tokenizer, model
