"""verl wiring of MemOPD (the last stage): config, row layouts, engines, teacher worker group, trainer.

config.py    the recipe's ``memopd:`` tree as a validated dataclass
rows.py      each row's restored positions / segments / teacher mask, written to TransferQueue
engine.py    FSDP engines that execute the row layouts (actor, ref, critic, teacher; streams.py re-lays the rows)
teacher.py   the forward-only teacher worker group and its start-up checks
reward.py    the task reward with the clipped KL penalty r - beta*[l_old - l_ref]_+
loss.py      the actor loss installed on verl's actor (PPO + full-vocabulary OPD)
audit.py     in-training checks every N steps: RCE spot-check, aligned-vs-flat teacher KL
ppo.py       the ``memopd`` trainer registered with verl's trainer registry
critic.py    the critic worker on the packed value-model engine

verl is imported before any module here: ``import verl`` loads verl's plugins, ours among them
(``verl_memopd.plugin``), which imports ``engine`` and ``ppo`` and, through them, the rest of this package. A
process whose first import is one of these modules (a Ray worker unpickling ``teacher.MemopdTeacherWorker``)
thus runs the plugin before that module, not from inside its half-run ``import verl``, where the plugin's
``from verl_memopd.trainer.teacher import ...`` would find it half-initialised (verl logs the failed plugin at
DEBUG level only and goes on without the trainer registration).
"""

import verl  # noqa: F401  (loads the plugin first; see above)
