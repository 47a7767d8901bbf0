"""Several nodes in one torchrun world: the second optional layer, over the core
(common/runtime/) and the trainer's ranks (common/runtime/ranks/). Nothing outside common/train.py
(the entry that picks a node's role) imports it."""
