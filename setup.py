"""dynatrain_megatron: online, in-memory switching of Megatron parallel layouts."""
from setuptools import find_packages, setup

setup(
    name="dynatrain_megatron",
    version="0.1.0",
    description="Switch the parallel layout of a running Megatron training job in memory",
    # configs/ is installed as dynatrain_megatron/shipped_configs/ so that models are
    # found by name from an installed package (dynatrain_megatron/configs.py)
    packages=find_packages(include=["dynatrain_megatron", "dynatrain_megatron.*"])
    + ["dynatrain_megatron.shipped_configs"],
    package_dir={"dynatrain_megatron.shipped_configs": "configs"},
    package_data={"dynatrain_megatron.shipped_configs": ["models/*.yaml",
                                                         "scenarios/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        # the CPU build on our dev/CI machines; GPU users install their CUDA torch first
        # (any 2.13.x build satisfies this pin), see README
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "psutil",  # megatron-core's checkpoint saving needs it but does not declare it
        "pyyaml",
        "numpy",
        "einops",  # megatron-core's HyperCommGrid / resharding need it, undeclared
        "tqdm",  # megatron-core's static inference engine (generation) imports it, undeclared
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "pytest-timeout"],
        "bench": ["matplotlib"],
        # what Megatron-LM's own training code (megatron/training, pretrain_gpt.py) imports
        # beyond megatron-core; compat/megatron_lm.py checks them at start-up. pybind11: a
        # checkout with its own megatron/core (core_v0.17+) has its dataset helper built
        # (megatron_lm/checkout.py)
        "megatron-lm": ["six", "regex", "pydantic", "pybind11"],
        # Transformer Engine needs CUDA; NVIDIA apex is a source install (see README).
        # PyPI's "apex" is an unrelated project and must never be listed here.
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["dynatrain=dynatrain_megatron.cli:main"]},
)
