"""Placement and the sharded execution of a DSA layer.

* ``plan``: the tensor-parallel plan as data (which tensor is split how, byte figures).
* ``placement``: the ``Placement`` value (mesh, head axis, optional batch axis) and what is
  split or replicated: parameters, call rows, caches.
* ``sharding``: ``shard_layer`` (the one place a layer is placed) and the cache shardings.
* ``execution``: the one execution of a call, placed or not, eager or traced.

This ``__init__`` imports nothing: the cache package places its page tables with
``placement.put``, below the layer, while ``sharding`` sits above it.
"""
