"""mooncake-connectors: Mooncake's KVCache-centric design as plugins for vLLM, SGLang, LMCache.

Importing the package is cheap: heavy optional dependencies load inside the module that needs them.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
