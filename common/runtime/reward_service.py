"""Reward-worker processes for expensive rewards (a reward model, a victim + classifier).

Processes: R spawned reward workers (`reward_worker_main`) and G generators holding a
`RewardClient`, on the trainer's node, or on each generator node when there are several nodes. A generator sends one request per finished group, (rank, texts, metas), on the
shared request queue and blocks on its own result queue; any free worker takes it, scores the
whole group in one batched call and answers on that generator's queue. The expensive model is
built once per worker by `make_reward_fn()` (any function: sent by value,
common/runtime/pickling.py), which returns `fn(texts: list, metas: list) -> list[float]`.

Failure rules: a batched call that raises is retried sample by sample; a sample that still
raises scores `error_reward` (`gen.error_reward`, default 0) and is counted (`n_errors` in the answer), the same contract as in-process
rewards (common/runtime/generator.py: score). Each process logs its first failing reward with
the traceback and only counts the later ones (`reward_failed`): one line per sample would bury
the log (a step of 64 samples printed 64), and the counts reach the metrics (`reward_errors` per
step) and the end of the run (`train` prints the total). A worker that dies is noticed by the
trainer's `Workers.check()`; a generator waiting on it gives up after `timeout` seconds with an error.
"""
from __future__ import annotations

import logging
import math
import queue as queue_mod
from typing import Callable

from common.contracts.batch import Scored

log = logging.getLogger("asyncrl.reward")
_logged: set[str] = set()  # the kinds of failure this process has already logged in full


def reward_failed(what: str, error_reward: float, exc: BaseException, where: str = "") -> None:
    """Log a failing reward (`what`: which function; `where`: e.g. the prompt): the first failure
    of `what` in this process with its traceback, later ones at DEBUG only (the caller counts them)."""
    if what in _logged:
        log.debug("%s failed%s (scored %g): %r", what, where, error_reward, exc)
        return
    _logged.add(what)
    log.warning("%s failed%s and scored %g; its traceback follows. Further failures are counted, not logged "
                "(reward_errors in each step's metrics, the total at the end of the run)", what, where,
                error_reward, exc_info=exc)


class RewardClient:
    """Picklable handle a generator uses to score a group on the reward workers."""

    def __init__(self, ctx, n_generators: int, timeout: float = 600.0, error_reward: float = 0.0, first: int = 0):
        """For generators first .. first + n_generators - 1 (their global numbers: on generator
        node j, j x train.n_generators onwards)."""
        self.error_reward = error_reward  # what a sample whose reward raises scores (the workers read it)
        self.requests = ctx.Queue()
        self.results = [ctx.Queue() for _ in range(n_generators)]
        self.timeout, self.first = timeout, first

    def score(self, rank: int, texts: list, metas: list, stop_event=None, beat=None) -> tuple[list[float], int] | None:
        """(rewards, n_errors) for one group, computed by whichever worker is free; None if
        `stop_event` is set while waiting (the run is shutting down). `beat`: the calling
        generator's heartbeat, called every poll (waiting on a worker is not a stall)."""
        self.requests.put((rank - self.first, list(texts), list(metas)))
        waited = 0.0
        while waited < self.timeout:
            try:
                return self.results[rank - self.first].get(timeout=0.5)
            except queue_mod.Empty:
                waited += 0.5
                if beat is not None:
                    beat("waiting")
                if stop_event is not None and stop_event.is_set():
                    return None
        raise TimeoutError(f"no reward from the reward workers within {self.timeout} s")


def _as_reward(r) -> float:
    """A reward as a float; a `Scored` (a float with its reason: a program's timeout, crash, refusal) kept as is."""
    return r if type(r) is Scored else float(r)


def _safe_scores(fn: Callable, texts: list, metas: list, error_reward: float = 0.0) -> tuple[list[float], int]:
    try:
        out = [_as_reward(r) for r in fn(texts, metas)]
        if len(out) != len(texts):
            raise ValueError(f"reward fn returned {len(out)} rewards for {len(texts)} texts")
        if all(math.isfinite(r) for r in out):
            return out, 0
    except Exception as e:  # noqa: BLE001 - find the bad sample(s) one by one below
        if "batched reward" not in _logged:
            _logged.add("batched reward")
            log.warning("batched reward failed (%r); scoring its samples one by one (said once per process)", e)
    out, errors = [], 0
    for t, m in zip(texts, metas):
        try:
            r = _as_reward(fn([t], [m])[0])
            if not math.isfinite(r):
                raise ValueError(f"reward {r}")
        except Exception as e:  # noqa: BLE001 - one bad sample scores error_reward, the run goes on
            reward_failed("the reward worker's reward fn", error_reward, e)
            r, errors = error_reward, errors + 1
        out.append(r)
    return out, errors


def reward_worker_main(make_reward_fn: Callable, client: RewardClient, *, stop_event, beat) -> None:
    """Process entry point (started by `common.runtime.launch.Workers.start`); `beat`: its heartbeat."""
    beat.start()
    beat("loading")
    fn = make_reward_fn()
    while not stop_event.is_set():
        beat("waiting")
        try:
            rank, texts, metas = client.requests.get(timeout=0.1)
        except queue_mod.Empty:
            continue
        beat("scoring", rank)  # request = the generator it scores for
        client.results[rank].put(_safe_scores(fn, texts, metas, client.error_reward))


def start_reward_workers(workers, hb, n: int, make_reward_fn: Callable, n_generators: int, error_reward: float,
                         first: int = 0) -> RewardClient:
    """Start `n` reward workers (named reward0.., heartbeats from `hb`) for the node's generators
    `first` .. `first + n_generators - 1`; the client those generators score with. Runs in the
    trainer (one node) or in a generator node's main process (several nodes: each node its own)."""
    client = RewardClient(workers.ctx, n_generators, error_reward=error_reward, first=first)
    for r in range(n):
        workers.start(f"reward{r}", reward_worker_main, make_reward_fn, client, beat=hb.beat_for(f"reward{r}"))
    return client
