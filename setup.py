"""The compiled part of kvoffload; everything else is in pyproject.toml.

Five C extensions, built by ``pip install -e .`` or ``pip install .`` with the C compiler and
Python headers any CPython build machine has (no CUDA toolkit: the driver's entry points are
resolved at run time). See docs/design.md, *The compiled core*.
"""

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]

setup(
    ext_modules=[
        Extension(
            "kvoffload._core.base.piece_copies",
            sources=["src/kvoffload/_core/base/piece_copies.c"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvoffload._core.base.call_checks",
            sources=["src/kvoffload/_core/base/call_checks.c"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvoffload._core.base.wake_semaphores",
            sources=["src/kvoffload/_core/base/wake_semaphores.c"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvoffload._core.tiers.index_records",
            sources=["src/kvoffload/_core/tiers/index_records.c"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvoffload._core.base.convoy_free_lock",
            sources=["src/kvoffload/_core/base/convoy_free_lock.c"],
            extra_compile_args=FLAGS,
        ),
    ],
)
