"""How the micro-batches of one step are shared among the trainer's N ranks, so that every rank runs
the same number of passes through the sharded model (`Share`, installed in `common.contracts.micro`).

Runs in every trainer rank: rank 0 installs its `Share` while each command runs
(common/runtime/ranks/group.py), ranks 1..N-1 for their whole life (common/runtime/ranks/rank.py).

Collective discipline: every rank runs the same algorithm code on the same batch, so they meet
the same collectives in the same order. Micro-batch passes are the exception (each rank runs
its own share); `Share` keeps their number equal by owing the short ranks zero-loss passes,
paid before the next collective (`Share.pay`), and a grad pass's backward follows its forward.
With `train.reshard` = "update" it also keeps the weights gathered and the gradients local
through an update, until one zero-loss "flush" pass (`end_backward`; common/runtime/ranks/fsdp.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from common.contracts.micro import Ranks
from common.contracts.ops import token_logp
from common.runtime.ranks.fsdp import group_of
from common.runtime.wire import all_gather_json


class Share(Ranks):
    """Rank r's share of the micro-batches: r, r + N, r + 2N, ... of every list, plus the
    zero-loss passes that bring it to the longest share (installed with `common.contracts.micro.set_ranks`)."""

    def __init__(self, model, rank: int, world: int, beat=None, reshard: str = "pass"):
        self.model, self.rank, self.world = model, rank, world
        self.beat = beat or (lambda: None)  # ranks 1..N-1: heartbeat on every list and payment
        self.hold = reshard == "update"  # keep weights gathered and gradients local until end_backward
        self._holding = False
        self.owed: list[bool] = []  # passes this rank owes the others: True = forward + backward
        self._dummy = torch.zeros(1, 2, dtype=torch.long, device=model.device)  # one target token
        self.group = group_of(model)

    def share(self, parts):
        self.beat()
        self.pay()  # passes owed from an earlier list come first, in order
        mine = parts[self.rank::self.world]
        # the kind of pass follows the caller's grad mode: a no-grad proximal pass owes forwards only
        self.owed += [torch.is_grad_enabled()] * (-(-len(parts) // self.world) - len(mine))
        if self.hold and torch.is_grad_enabled() and not self._holding:
            self._hold(True)
        return mine

    def _hold(self, on: bool) -> None:
        """reshard="update": accumulate full gradients locally, keep the weights gathered."""
        self._holding = on
        self.model.set_requires_gradient_sync(not on)
        self.model.set_reshard_after_backward(not on)

    def end_backward(self) -> None:
        """After an algorithm's backward: the owed passes, then (reshard="update") one zero-loss
        pass with gradient sync on, whose backward reduce-scatters the accumulated gradients
        and frees the gathered weights, so the optimizer steps on shards."""
        self.pay()
        if self._holding:
            self._hold(False)
            self.owed = [True]
            self.pay()

    def pay(self) -> None:
        """Run the owed passes through the model's __call__ (so FSDP gathers, and reduces in backward)."""
        owed, self.owed = self.owed, []
        if owed:
            self.beat()
        for grad in owed:
            with torch.set_grad_enabled(grad):
                lp = token_logp(self.model, self._dummy, 1.0)
                if grad:
                    (lp.sum() * 0).backward()  # zero gradients, the same reduce-scatters as a real pass

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        self.pay()
        dist.all_reduce(x, group=self.group)
        return x

    def sum_stats(self, stats: dict) -> dict:
        self.pay()
        every = all_gather_json({k: float(v) for k, v in stats.items()}, self.group, self._dummy.device)  # JSON, not pickles
        keys = list(dict.fromkeys(k for d in every for k in d))  # a rank with no micro-batch has no keys
        return {k: sum(d.get(k, 0.0) for d in every) for k in keys}
