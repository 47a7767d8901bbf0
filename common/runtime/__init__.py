"""The processes of a run and what they share: the one-node core (launcher, weights, buffer,
generators, reward service, the trainer loop and its step, checkpoints, the stream, the watchdog),
plus two optional layers on top of it: the trainer as N ranks (ranks/) and several nodes (nodes/).
Imports point one way, nodes -> ranks -> core; the entry (common/train.py) picks the layers a run
needs.

Nothing here knows an algorithm: the trainer calls `common.algorithm.Algorithm`."""
