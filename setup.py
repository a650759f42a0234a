"""The optional compiled part of the package: the tcp transport's per-request loops
(``_tcp_fast.pyx``, built with Cython). Every setting of the project lives in pyproject.toml;
this file only declares the extension. It is ``optional``: without a C compiler the install
goes on, and the transport runs its pure-Python loops (same frames, same behaviour)."""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # building without Cython (e.g. an sdist tool): pure Python only
    extensions = []
else:
    extensions = cythonize(
        [
            Extension(
                "mooncake_connectors.transfer_core.transports._tcp_fast",
                ["mooncake_connectors/transfer_core/transports/_tcp_fast.pyx"],
                optional=True,
            )
        ],
        compiler_directives={"language_level": 3},
        quiet=True,
    )

setup(ext_modules=extensions)
