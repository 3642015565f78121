"""Adds verl-memopd's configs to Hydra's search path, so ``+recipe=memopd`` resolves.

Hydra discovers ``SearchPathPlugin`` subclasses in the ``hydra_plugins`` namespace package of
every installed distribution; this one appends ``pkg://verl_memopd.hydra_configs`` for every
Hydra app (verl's ``main_ppo`` included), from any working directory.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class VerlMemopdSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="verl-memopd", path="pkg://verl_memopd.hydra_configs")
