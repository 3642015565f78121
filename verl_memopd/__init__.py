"""verl-memopd: Memory-Aligned On-Policy Distillation (MemOPD) as a verl plugin.

The data flow is the package layout, one stage per module::

    tasks          memory benchmark rows (procedural), F1 reward
      -> agent       memory agent loop in verl's agent loop (vLLM rollout)
      -> records     exact invocation records: token ids in/out, rollout log-probs
      -> packing     layouts packed | per_call | flat; restored positions and segments
         streams     packed rows re-laid for an engine: each call alone, a prompt group's q once
      -> segments    attention metadata of a token stream: which keys each token sees
      -> attention   executes a layout: torch reference / flash-attn varlen
      -> supervision teacher -> actor transport (hidden states | top-k + tail)
      -> losses      chunked full-vocabulary divergences, PPO + OPD actor loss
      -> trainer/    verl wiring: row layouts, packed engines, teacher worker group, reward
                     penalty, actor loss, audits, the memopd trainer (recipe: hydra_configs/recipe/memopd.yaml)

    platform / patches: verl on CPU (tests and smoke runs only)
    fields         every key the stages add to verl's data (one home)

    the lab, which studies the stages and is never imported by them: bench/ (benchmarks, tiny models, the GPU
    check) and experiment/ (the CPU experiments). Command lines (``__main__``) may use it;
    ``tests/test_house.py`` holds the stages to the rule and to no import cycle.

Importing this package has no side effects; ``verl_memopd.plugin`` is what verl's
``verl.plugins`` entry point loads, and it only registers things.

Every stage above ``trainer/`` (and ``rce``, ``tiny``, the benches) imports with torch and transformers
alone: verl, Ray, vLLM, tensordict, Hydra and OmegaConf are needed only by the verl wiring --
``trainer/``, ``platform/``, ``plugin``, the agent loop ``agent/loop.py`` and ``losses/actor.py`` (verl's
PPO loss plus MemOPD's terms). ``tests/test_imports_without_verl.py`` holds every other module to that.
"""

__version__ = "0.1.0"
