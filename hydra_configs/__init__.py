"""Hydra configs of verl-memopd, installed as ``verl_memopd.hydra_configs`` (see setup.py).

``recipe/<name>.yaml`` is selected with ``+recipe=<name>`` on verl's command line; the search
path is added by ``hydra_plugins/verl_memopd``.
"""
