"""The decoder and its layers, as one process runs them: the families as settings (model_config.py),
the transformer (transformer.py), its layers, linear and attention kernels, the chunked head, packed
training rows and shared prompts, the kernel switches. Imports the contracts only: the lowest room
of the engine (model -> checkpoints -> kv -> sampler -> machine, each importing only those before)."""
