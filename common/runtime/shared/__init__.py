"""What the processes of a run share in memory: the double-buffered weight store (weights.py) and
the ring replay buffer with its sampling and its file (buffer.py, buffer_sampling.py,
buffer_file.py). The lowest room of the runtime: it imports the engine and the contracts only."""
