"""The other nodes as the trainer loop sees them: `Peers`, a handful of calls at fixed points of the
loop. Here there are none, so each call gives the one-node answer or does nothing.

Runs in the trainer process. Several nodes under torchrun: `TrainerLink` (common/runtime/nodes/link.py)
subclasses it, sends each publish to the generator nodes, mirrors the admission quota to them and
fills the buffer from them; the entry (common/train.py) picks which one the loop gets. In the
order the loop (common/runtime/trainer.py) calls them:
  Peers(cfg, tc, store, setup)   `setup`: what other nodes need to build their store and buffer
  control(...)                   the admission gate the trainer moves (`Control`)
  publish(v)                     after the local publish: the weights to the other nodes
  local_generators(n)            the numbers of the generators this node runs
  generator_control(control)     what those generators claim prompts with
  check()                        raise for a node that failed (wherever the loop waits)
  stop()                         the run is over: every other node stops
"""
from __future__ import annotations

from typing import Optional

from common.runtime.generator import Control


class Peers:
    """No other node (module docstring). Use as a context manager."""

    keys = None  # the run's key-value store (common/runtime/nodes/keys.py) when there are other nodes

    def __init__(self, cfg, tc, store, setup: dict):
        pass

    def control(self, ctx, buffer, prompts_per_version: int, max_staleness: Optional[int], n_generators: int) -> Control:
        """The admission gate (common/runtime/generator.py) for `n_generators` generators."""
        return Control(ctx, prompts_per_version, max_staleness, n_generators)

    def publish(self, version: int) -> None:
        """Version `version`, just published here, to every other node."""

    def local_generators(self, n: int) -> range:
        """The numbers of the generators this node runs (their seeds and statistics rows): all `n`."""
        return range(n)

    def generator_control(self, control: Control) -> Control:
        """What this node's generators claim with: the trainer's `Control` itself."""
        return control

    def check(self) -> None:
        """Raise for another node that failed."""

    def pids(self) -> dict[str, int]:
        """This node's processes that talk to the others, by name (workers.json): none."""
        return {}

    def stop(self) -> list[str]:
        """Stop every other node; returns those that did not say they were done."""
        return []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False
