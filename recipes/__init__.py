"""Built-in recipes: one folder each, holding `recipe.toml` and `tasks.py`."""
