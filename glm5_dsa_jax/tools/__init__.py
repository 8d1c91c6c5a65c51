"""The tools behind the ``glm5-dsa`` command, kept apart from the layer they measure.

``bench`` (the decode benchmark), ``bench_cp`` (the decode step split over a sequence
axis against one device, ``bench decode --cp N``), ``roofline`` (bytes, FLOPs and bound time per kernel),
``cache_accuracy`` (fp8 cache against bf16 cache), ``demo`` (a padded batch, prefill then
decode), ``memory_plan`` (per-device weights and caches on a data x cp x tp mesh), ``gpu_compile``
(deviceless compile of every Pallas kernel for NVIDIA GPUs) and ``indexer_training``
(``train_indexer``: the lightning indexer's two training stages, ``glm5-dsa train-indexer``);
for the GPU checks, ``timing`` (a step inside one program against a call, the device's
rates), ``kernel_trace`` (a profile's kernels per step) and ``float32_rule`` (how a 16-bit
gradient is judged right: by its distance from float32 against bf16 ``"xla"``'s). Each imports the layer, its
caches and kernels; nothing in the layer imports a tool, so the layer runs without them
(``glm5_dsa_jax.MemoryPlan`` is the one tool name the package re-exports). ``glm5_dsa_jax.cli``
parses the flags and prints; the work and its documentation live here.
"""
