"""verl wiring of MemOPD (the last stage): config, row layouts, engines, teacher worker group, trainer.

    config.py    the recipe's ``memopd:`` tree as a validated dataclass
    rows.py      each row's restored positions / segments / teacher mask, written to TransferQueue
    engine.py    FSDP engines that execute the packed layout (actor, ref, critic, teacher)
    teacher.py   the forward-only teacher worker group and its start-up checks
    loss.py      the actor loss installed on verl's actor (PPO + full-vocabulary OPD)
    ppo.py       the ``memopd`` trainer registered with verl's trainer registry
"""
