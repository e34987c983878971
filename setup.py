"""The compiled part of kvoffload; everything else is in pyproject.toml.

One C extension, built by ``pip install -e .`` or ``pip install .`` with the C compiler and
Python headers any CPython build machine has (no CUDA toolkit: the driver's entry points are
resolved at run time). See docs/design.md, *The compiled core*.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvoffload._core.base.piece_copies",
            sources=["src/kvoffload/_core/base/piece_copies.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        ),
    ],
)
