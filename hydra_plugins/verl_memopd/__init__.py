"""Hydra search-path plugin of verl-memopd (``hydra_plugins`` is a namespace package: no __init__ there)."""
