"""The optional compiled part of the package: the tcp transport's per-request loops
(``_tcp_fast.pyx``, built with Cython). Every setting of the project lives in pyproject.toml;
this file only declares the extension. It is ``optional``: without a C compiler the install
goes on, and the transport runs its pure-Python loops (same frames, same behaviour). The rdma
transport's compiled data path (``_rdma_fast.pyx``, over libibverbs) is optional the same way:
without a compiler or libibverbs-dev the rails post through pyverbs."""

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
            ),
            # the rdma transport's compiled data path, over libibverbs (libibverbs-dev)
            Extension(
                "mooncake_connectors.transfer_core.transports.rdma._rdma_fast",
                ["mooncake_connectors/transfer_core/transports/rdma/_rdma_fast.pyx"],
                include_dirs=["mooncake_connectors/transfer_core/transports/rdma"],
                libraries=["ibverbs"],
                optional=True,
            ),
        ],
        compiler_directives={"language_level": 3},
        quiet=True,
    )
    # cythonize builds new Extension objects and drops ``optional``; without this a machine
    # lacking libibverbs-dev (or a compiler) fails the whole install instead of going on.
    for ext in extensions:
        ext.optional = True

setup(ext_modules=extensions)
