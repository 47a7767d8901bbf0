"""A run checked before anything loads: the devices it names, `--random_weights`' local models and
`--print-memory` (preflight.py), the memory plan from the models' configs (memory_plan.py), its
ledger (memory_ledger.py) and what to change where it does not fit (memory_fixes.py). Runs in the
launching process; imports the engine and the contracts."""
