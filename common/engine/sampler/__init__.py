"""The hand-written batched sampler: requests, continuous batching and its rows (sampler.py,
live_batch.py, slot_log.py), the sampling distribution and its counter-based draws (sampling.py),
prefill and the captured decode step with its attention and merged layers (prefill.py, decode.py,
decode_model.py, decode_attention.py), preemption and resume when the pool runs short
(preempt.py), a step in flight (inflight.py). Imports the kv, checkpoints and model rooms and the
contracts."""
