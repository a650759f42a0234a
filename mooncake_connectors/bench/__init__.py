"""Harness code: benchmarks, the PD demo and what it launches, the tiny-model builder.

Nothing here is imported by the library itself; only the command line reaches it, lazily, inside
the command that needs it. That keeps engine launchers, subprocess helpers and synthetic traffic
out of the import graph of anything a serving engine loads. This package may import every other
part of the package; no other part may import it.

Modules: ``transfer`` (transfer engine), ``store``, ``store_memory``, ``store_ssd`` (store),
``vllm_pd``, ``vllm_store``, ``vllm_ec``, ``conductor_live`` (vLLM), ``sglang``, ``lmcache``,
``moe`` and ``moe_workload`` (synthetic MoE traffic), ``demo``, ``launch`` (server processes)
and ``tiny_model``.
"""
