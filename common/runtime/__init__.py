"""The processes of a run and what they share: the one-node core here (launcher, spawning,
watchdog, generators, reward service, the trainer loop and its step, the run's log and the
network's wire format), over two rooms below it: shared/ (the weight store and the replay buffer
in shared memory) and files/ (checkpoints, state, the stream, run folders); plus two optional
layers on top: the trainer as N ranks (ranks/) and several nodes (nodes/). Imports point one way,
nodes -> ranks -> core -> files -> shared; the entry (common/train.py) picks the layers a run needs.

Nothing here knows an algorithm: the trainer calls `common.contracts.algorithm.Algorithm`."""
