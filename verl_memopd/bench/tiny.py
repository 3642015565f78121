"""Tiny offline models: a locally trained tokenizer, a tiny student and a larger tiny teacher.

No hub is reachable on our CI machines, so tests and the CPU smoke run use models this module
builds from a seed, in seconds::

    python -m verl_memopd.bench.tiny --out DIR [--seed 0]

writes ``DIR/student`` and ``DIR/teacher``: Qwen2-style causal LMs (random init) that share one
byte-level BPE tokenizer trained on the memory benchmark's text (:data:`VOCAB_SIZE`, 1374 tokens on
seed 0), with a ChatML chat template, ``<|im_end|>`` as eos and ``<|endoftext|>`` as pad. Both load with
transformers' Auto classes and with vLLM's CPU build (vLLM CPU needs head_dim >= 32).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TinyPaths", "student_config", "teacher_config", "student_model", "build_tokenizer", "build", "main"]

PAD, BOS_CHAT, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS_CHAT, EOS]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: The tiny vocabulary, one number: byte-level BPE on the benchmark's text runs out of merges at 1374
#: tokens (3 special + 256 bytes + 1115 merges) on seed 0's corpus, so the trainer is capped here and
#: :func:`build` with seed 0 sizes both models to exactly this many rows. Other seeds' corpora give a few
#: tokens fewer (1373 on seed 1, 1366 on seed 2; ``build`` sizes the models by the tokenizer and records it
#: in ``tiny.json``), so any tiny tokenizer's ids fit a model of ``VOCAB_SIZE`` rows, the size the
#: in-memory models (:func:`student_model`, tests, the RCE self-test) default to.
VOCAB_SIZE = 1374
#: Text samples from the memory benchmark used to train the tokenizer.
CORPUS_SAMPLES = 4000


@dataclass(frozen=True)
class TinyPaths:
    student: Path
    teacher: Path


def _qwen2_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, seed_name: str):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_id=2,  # <|im_end|>, see SPECIAL_TOKENS
        pad_token_id=0,  # <|endoftext|>
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.name_or_path = seed_name
    return cfg


def student_config(vocab_size: int = VOCAB_SIZE):
    """The tiny student: 2 layers, hidden 128, 4 heads (head_dim 32), 2 KV heads."""
    return _qwen2_config(vocab_size, hidden=128, layers=2, heads=4, kv_heads=2, seed_name="memopd-tiny-student")


def teacher_config(vocab_size: int = VOCAB_SIZE):
    """The tiny teacher: 4 layers, hidden 256, 8 heads (head_dim 32), 4 KV heads."""
    return _qwen2_config(vocab_size, hidden=256, layers=4, heads=8, kv_heads=4, seed_name="memopd-tiny-teacher")


def student_model(vocab_size: int = VOCAB_SIZE, seed: int = 0, attention: str | None = None):
    """The tiny student in memory, untrained: fp32, eval mode, weights drawn from ``seed``.

    ``attention``: a ``verl_memopd.attention`` backend name (``"torch"``, ...) so packed layouts run, or
    None for transformers' default (sdpa). For tests and self-checks; :func:`build` writes models to disk.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(student_config(vocab_size)).eval()
    if attention is not None:
        from verl_memopd.attention import hf_name

        model.set_attn_implementation(hf_name(attention))
    return model


def build_tokenizer(seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE on benchmark text; returns a ``PreTrainedTokenizerFast`` of at most
    ``vocab_size`` tokens (exactly :data:`VOCAB_SIZE` on seed 0, where the merges run out).

    Special token ids are fixed: ``<|endoftext|>`` = 0 (pad), ``<|im_start|>`` = 1, ``<|im_end|>`` = 2 (eos).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from verl_memopd.tasks.generator import corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(corpus(CORPUS_SAMPLES, seed)) + ["system user assistant\n"]
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=None)
    hf.add_special_tokens({"additional_special_tokens": [BOS_CHAT]})
    hf.chat_template = CHATML_TEMPLATE
    ids = hf.convert_tokens_to_ids(SPECIAL_TOKENS)
    if ids != [0, 1, 2]:
        raise RuntimeError(f"tiny tokenizer: special token ids {ids}, expected [0, 1, 2]")
    if len(hf) > vocab_size:
        raise RuntimeError(f"tiny tokenizer: {len(hf)} tokens, more than the cap vocab_size={vocab_size}")
    return hf


def _save_model(cfg, tokenizer, out: Path, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build(out_dir: str | Path, seed: int = 0) -> TinyPaths:
    """Build tokenizer, student and teacher under ``out_dir``, deterministically from ``seed``."""
    out = Path(out_dir)
    tokenizer = build_tokenizer(seed)
    vocab = len(tokenizer)
    student = _save_model(student_config(vocab), tokenizer, out / "student", seed)
    teacher = _save_model(teacher_config(vocab), tokenizer, out / "teacher", seed + 1)
    (out / "tiny.json").write_text(json.dumps({"seed": seed, "vocab_size": vocab}) + "\n")
    return TinyPaths(student=student, teacher=teacher)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m verl_memopd.bench.tiny")
    parser.add_argument("--out", required=True, help="output folder (student/ and teacher/ are written in it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = build(args.out, args.seed)
    print(f"tiny student={paths.student} teacher={paths.teacher}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
