"""Install giantmodel and build its communication extension when a C++ compiler exists.

torch is required at run time but never at build time: the C++ core has a C
ABI and is loaded with ctypes, so pip's isolated build never pulls a torch
wheel, and an installed torch is never replaced.
"""

import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))
try:
    from build_ext import get_cmdclass, get_extensions
except ImportError:  # a source tree without csrc/: pure-Python install
    def get_extensions():
        return []

    def get_cmdclass():
        return {}

# ruff is pinned: its rule set changes between releases, and CI checks it.
TEST = ["pytest>=7", "pytest-timeout>=2", "transformers>=4.45", "tokenizers>=0.19",
        "datasets>=2.19", "pyarrow>=14", "tensorboard>=2.14", "import-linter>=2.1",
        "ruff==0.17.6", "peft>=0.13", "torchao>=0.10",
        # the Stable Diffusion tests check parity with diffusers' modules
        "diffusers>=0.30", "Pillow>=10",
        # giantmodel plot, estimate --plot and plan --plot
        "matplotlib>=3.7"]

setup(
    name="giantmodel",
    version="0.1.0",
    description="Train GPT and LLaMA models with N-D parallelism from one YAML file",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["giantmodel", "giantmodel.*"]),
    package_data={"giantmodel": ["py.typed"]},
    install_requires=[
        # A range that an installed torch satisfies installs nothing more.
        # 2.11 is the oldest torch the code is checked against: every newer
        # API it uses goes through a probe in giantmodel/core/compat.py.
        # Older releases lack APIs used unprobed (varlen_attn's window_size,
        # FSDP2 and DTensor keywords).
        "torch>=2.11",
        "pyyaml>=6",
        "sentencepiece>=0.2",
        "safetensors>=0.4",
        "numpy>=1.24",
    ],
    extras_require={
        "hf": ["transformers>=4.45", "tokenizers>=0.19", "datasets>=2.19", "pyarrow>=14"],
        # QLoRA's NF4 base weights; peft only to load exported adapters.
        "lora": ["torchao>=0.10", "peft>=0.13"],
        "sd": ["diffusers>=0.30", "transformers>=4.45", "Pillow>=10"],
        "te": ["transformer-engine[pytorch]>=1.10"],
        # run.loggers=[wandb, mlflow]; mlflow-skinny is MLflow's client
        # without its server and UI (pip install mlflow adds them)
        "track": ["wandb>=0.17", "mlflow-skinny>=2.10"],
        # PNG pictures: giantmodel plot, estimate --plot, plan --plot
        "plot": ["matplotlib>=3.7"],
        "test": TEST,
        "dev": TEST,
    },
    entry_points={"console_scripts": ["giantmodel=giantmodel.cli:main"]},
    ext_modules=get_extensions(),
    cmdclass=get_cmdclass(),
    zip_safe=False,
)
