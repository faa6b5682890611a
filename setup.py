"""Install pytorch_mem_profiler: ``pip install -e .`` (tests: ``pip install -e '.[test]'``)."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = {}
for line in (here / "pytorch_mem_profiler" / "__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        exec(line, version)

setup(
    name="pytorch_mem_profiler",
    version=version["__version__"],
    description="Where a PyTorch training loop's GPU memory goes, layer by layer, every few iterations.",
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["pytorch_mem_profiler", "pytorch_mem_profiler.*"]),
    package_data={"pytorch_mem_profiler": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "pandas>=1.5"],
    extras_require={
        # The plot and report tests draw; the integration tests run the real frameworks; the zoo builds models.
        "test": [
            "pytest>=7",
            "matplotlib>=3.5",
            "lightning>=2.0",
            "transformers>=4.40",
            "accelerate>=0.30",
            "tqdm>=4.60",
            "tensorboard>=2.10",
        ],
        # The model zoo's vision models (benchmarks/zoo: ViT and Swin by timm; ResNet, ConvNeXt,
        # EfficientNet, MobileNet by torchvision), for its tests: apart from "test" because PyPI's
        # torchvision is built for PyPI's default (CUDA) torch, and beside torch's CPU build it fails
        # at import, which breaks Lightning's import too. With the CPU build, install torchvision
        # from the same index as torch.
        "zoo": ["timm", "torchvision"],
        "lightning": ["lightning>=2.0"],
        "transformers": ["transformers>=4.40", "accelerate>=0.30"],
        "plot": ["matplotlib>=3.5"],
        "nvml": ["nvidia-ml-py>=12"],
        "tensorboard": ["tensorboard>=2.10"],
    },
    entry_points={"console_scripts": ["pytorch-mem-profiler=pytorch_mem_profiler.analysis.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "License :: OSI Approved :: MIT License",
    ],
)
