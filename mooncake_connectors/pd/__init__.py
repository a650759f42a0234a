"""Prefill/decode disaggregation without an engine: the protocol every PD party speaks.

- :mod:`.params`: the ``kv_transfer_params`` schema shared by the proxy, the engine connector
  and the benchmarks;
- :mod:`.messages` and :mod:`.side_channel`: the worker-to-worker side channel (layouts, "done"
  notices, layer-wise push);
- :mod:`.layout`: KV block geometry and the transfer requests that copy blocks between ranks;
- :mod:`.plan`: what the scheduler side tells the workers each step, from plain token and block
  ids;
- :mod:`.session` and :mod:`.push`: a worker's transfers (leases, done notices, loads, pushes),
  given ``block_size``, ``tp_size`` and ``tp_rank`` as plain integers.

Nothing here imports an inference engine or torch; an engine adapter converts its own request,
block and tensor objects and forwards.
"""
