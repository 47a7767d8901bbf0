"""What this machine runs fastest, measured rather than assumed: the CPU's flags and the timings
behind `precision=auto` (cpu.py), the precision a process loads a model at (precision.py), the
decode step's compiled-or-eager choice (decode_choice.py). The top room of the engine: it imports
the sampler, checkpoints and model rooms and the contracts."""
