"""The sampler's KV caches: static slots (static_cache.py), the paged pool, its page tables and
refcounts (paged_cache.py, pages.py), which cache a sampler gets and how big, and what one sample
needs of it (budget.py, pages.py: sample_kv_tokens), and the non-blocking copies of their tables to
the device (transfer.py: the cache owns its tables' device copies). Imports the model room (its
attention) and the contracts."""
