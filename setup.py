"""Packaging for megatron_tlt.

Install with `pip install --no-build-isolation -e ".[dev]"` after installing torch:
the C++/CUDA extension in csrc/ (when present) is built against the torch already in
the environment, and build isolation would pull an unpinned (multi-GB, CUDA) torch.
`scripts/setup_env.sh` does both steps.

csrc/ is not a package: its build description `csrc/setup_ext.py` (get_extensions()
and get_cmdclass()) is loaded from its file path when it exists. TLT_SKIP_EXT=1
installs the Python package without building the extension.
"""

import importlib.util
import os
import re

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def read_version() -> str:
    # Read, not import: importing the package could need torch and friends.
    with open(os.path.join(ROOT, "megatron_tlt", "__init__.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__\s*=\s*"([^"]+)"', f.read(), re.M)
    if match is None:
        raise RuntimeError("__version__ not found in megatron_tlt/__init__.py")
    return match.group(1)


def load_extension() -> tuple[list, dict]:
    """(ext_modules, cmdclass) from csrc/setup_ext.py, or nothing if it is absent."""
    path = os.path.join(ROOT, "csrc", "setup_ext.py")
    if not os.path.isfile(path) or os.environ.get("TLT_SKIP_EXT") == "1":
        return [], {}
    spec = importlib.util.spec_from_file_location("megatron_tlt_setup_ext", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        if e.name == "torch":
            raise SystemExit(
                "megatron_tlt: building the csrc/ extension needs torch at build time. Install torch "
                "first, then `pip install --no-build-isolation -e .` (or set TLT_SKIP_EXT=1 to skip it)."
            ) from None
        raise
    return list(module.get_extensions()), dict(module.get_cmdclass())


ext_modules, cmdclass = load_extension()

setup(
    name="megatron_tlt",
    version=read_version(),
    description=(
        "RL post-training (GRPO) on Megatron-Core with lossless adaptive speculative-decoding rollouts"
    ),
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    if os.path.isfile(os.path.join(ROOT, "README.md"))
    else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_tlt", "megatron_tlt.*"]),
    # Non-Python files shipped inside the package (the tiny tokenizer, the tiny default policy).
    package_data={"megatron_tlt": ["data/assets/**/*", "assets/**/*"]},
    install_requires=[
        "torch>=2.4",  # not pinned here: the environment chooses the build (scripts/setup_env.sh)
        "megatron-core==0.16.1",
        "nvidia-ml-py",
        "safetensors",
        "tokenizers",
        "transformers",
        "pyyaml",
        "tqdm",
        "rich",
        "numpy",
        "pyarrow",
        "math-verify",
        "psutil",  # Megatron dist-checkpoint writer
    ],
    extras_require={
        "dev": ["pytest", "scipy", "matplotlib"],
        "plot": ["matplotlib"],
        "te": ["transformer-engine[pytorch]"],
        "vllm": ["vllm"],
    },
    entry_points={"console_scripts": ["megatron-tlt = megatron_tlt.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
