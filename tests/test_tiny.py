"""The tiny models' vocabulary is one number: the tokenizer, both models, ``tiny.json`` and the in-memory
models all have :data:`verl_memopd.bench.tiny.VOCAB_SIZE` tokens (seed 0, the seed every test and run uses)."""

from __future__ import annotations

import json

from transformers import AutoConfig, AutoTokenizer

from verl_memopd.bench.tiny import VOCAB_SIZE, student_config, student_model, teacher_config


def test_tokenizer_models_and_record_agree_on_the_vocabulary(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.student)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    record = json.loads((tiny_models.student.parent / "tiny.json").read_text())
    sizes = {
        "tokenizer": len(tokenizer),
        "tiny.json": record["vocab_size"],
        "student": AutoConfig.from_pretrained(tiny_models.student).vocab_size,
        "teacher": AutoConfig.from_pretrained(tiny_models.teacher).vocab_size,
    }
    assert sizes == dict.fromkeys(sizes, VOCAB_SIZE), sizes
    assert len(merges) == VOCAB_SIZE - 3 - 256  # BPE ran out of merges below the cap: 3 special + 256 bytes


def test_in_memory_models_default_to_the_same_vocabulary():
    assert student_config().vocab_size == teacher_config().vocab_size == VOCAB_SIZE
    assert student_model().get_output_embeddings().weight.shape[0] == VOCAB_SIZE
