"""Memory benchmark (stage 0 of the data flow): procedural episodes, prompts, F1 reward, oracle.

``generator`` builds seeded episodes (K questions, N chunks, look-alike distractors) from a
synthetic ``world``; ``prompts`` holds every text the model reads; ``reward`` scores answers
(SQuAD token F1 / EM); ``oracle`` is a scripted memory policy that solves every episode;
``dataset`` converts episodes to and from verl's RL parquet rows.
CLI: ``python -m verl_memopd.tasks build|oracle|convert ...``; ``convert`` turns your own long-context QA
(MemAgent-style or plain JSONL/parquet) into the same rows.
"""
