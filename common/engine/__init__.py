"""One process holds, loads, saves, runs and samples a model here; nothing in it knows another
process exists. Its rooms, each importing only those before it: model/ (the decoder and its
layers), checkpoints/ (Hugging Face in and out, shapes, the tiny model), kv/ (the caches and the
page allocator), sampler/ (the sampler and its decode step), machine/ (what this machine runs
fastest)."""
