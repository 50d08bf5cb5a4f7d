"""The part of the build pyproject.toml does not say: wirecore's C extension.

Optional: where it cannot be compiled (no C compiler) the install still succeeds and
the lanes use the same path in Python (inter/data/transport/wirecore.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "isthmus.inter.data.transport._wirecore",
            sources=["inter/data/transport/wirecore.c"],
            # -std=c11: no FMA contraction of the sums (the bits numpy's adds give).
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ]
)
