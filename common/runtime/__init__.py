"""The processes of a run and what they share (launcher, weights, buffer, generators, trainer).

Nothing here knows an algorithm: the trainer calls `common.algorithm.Algorithm`."""
