"""The model: one DSA layer (``layer``: ``DsaAttention``, ``DsaIndexer``, the pipeline's step
methods and its one pipeline ``forward``), its config (``config``, ``config_json``: HF
``config.json`` spellings), the tensor table (``layout``: HF names, shapes, placement,
parameter creation), HF weights <-> parameters (``weights``), input checks (``inputs``),
RoPE (``rope``) and the layer's arithmetic (``ops``).

This ``__init__`` imports nothing: the cache package sits between the config (which it
reads) and the layer (which reads the caches), so re-exporting the layer here would make
``glm5_dsa_jax.cache`` import the layer. The public names are ``glm5_dsa_jax``'s.
"""
