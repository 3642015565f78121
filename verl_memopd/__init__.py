"""verl-memopd: Memory-Aligned On-Policy Distillation (MemOPD) as a verl plugin.

The data flow is the package layout, one stage per module::

    tasks          memory benchmark rows (procedural), F1 reward
      -> agent       memory agent loop in verl's agent loop (vLLM rollout)
      -> records     exact invocation records: token ids in/out, rollout log-probs
      -> packing     layouts packed | per_call | flat; restored positions and segments
      -> segments    attention metadata of a token stream: which keys each token sees
      -> attention   executes a layout: torch reference / flash-attn varlen
      -> supervision teacher -> actor transport (hidden states | top-k + tail)
      -> losses      chunked full-vocabulary divergences, PPO + OPD actor loss
      -> trainer/    verl wiring: row layouts, packed engines, teacher worker group, reward
                     penalty, actor loss, audits, the memopd trainer (recipe: hydra_configs/recipe/memopd.yaml)

    platform / patches: verl on CPU (tests and smoke runs only)

Importing this package has no side effects; ``verl_memopd.plugin`` is what verl's
``verl.plugins`` entry point loads, and it only registers things.
"""

__version__ = "0.1.0"
