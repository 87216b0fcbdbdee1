"""What a daemon serves for one rank, planned from a checkpoint's headers before any data is read.

Pure Python (no torch, no I/O beyond reading the checkpoint's headers and a data sample). Its modules in the
order they import each other, each importing only those before it (tests/server/test_boundary.py):

1. ``checkpoint`` — a safetensors checkpoint directory: its files validated and kept open, headers, the
   fingerprint;
2. ``quant`` — quantized checkpoints (FP8 block-wise) and the dtype a rank is served in;
3. ``sharding`` — shard plans: which slice of each tensor a tensor-parallel rank holds;
4. ``layout`` — where each (sharded, cast) tensor lives in the rank's slab; ``reshard`` — which bytes of which
   source slabs fill a slab of another layout (the fleet fill), from two layouts;
5. ``key`` — the request (``RankSpec``) and the identity of its bytes (``WeightCacheKey``), and the proof of
   its files; ``facts`` — the daemon's side of that proof (what it recorded of the files it read) and the
   mismatch errors; ``recipe`` — the key of deposited (post-processed) weights;
6. ``rank`` — the planner, the one module that composes the others: ``plan_rank(spec)`` makes one ``RankPlan``
   (checkpoint, key, plan, layout), which also lays out the checkpoint's other ranks (a fleet fill's sources).

An engine's restart imports ``key`` alone: it names the lower modules only inside the functions that scan a
checkpoint's headers, which the files' proof spares it (docs/protocol.md §4.3.1). This module imports nothing.
"""
