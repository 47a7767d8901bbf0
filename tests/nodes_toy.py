"""The toy run of tests/test_e2e.py as a script, for tests/test_nodes.py: run it plainly (one
node) or under torchrun (each node runs this same command line).

    python tests/nodes_toy.py --model=DIR --run_root=DIR [--train.mode=sync ...]
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for `common`, `tba` and `tests`

from common.engine.machine.precision import PrecisionConfig  # noqa: E402
from common.runtime.generator import GenConfig  # noqa: E402
from common.runtime.train_config import TrainConfig  # noqa: E402
from common.task import RunConfig, make_algo, make_config, setup  # noqa: E402 - after the path
from common.train import train  # noqa: E402
from tests.test_e2e import _prompts, make_toy_batched_reward, toy_reward  # noqa: E402


_calls = [0]


def dying_reward(tokens, meta) -> float:
    """toy_reward, but the generator process exits abruptly after $NODES_TOY_DIE_AFTER samples (a fault)."""
    _calls[0] += 1
    if _calls[0] > int(os.environ["NODES_TOY_DIE_AFTER"]):
        os._exit(3)
    return toy_reward(tokens, meta)


def config(argv: list[str]) -> RunConfig:
    """test_e2e's toy settings (fp32, tiny batches), then the command line (`--algo=areal`: AReaL's defaults)."""
    base = RunConfig(name="toy", gen=GenConfig(max_batch=16, max_new_tokens=6, n=4, temperature=1.0),
                     train=TrainConfig(steps=6, lr=3e-3, warmup_steps=1, prompts_per_step=4, sync_every=2,
                                       min_buffer=16, buffer_capacity=512, micro_batch_tokens=256, stall_timeout=60),
                     precision=PrecisionConfig(dtype="fp32"))
    base.tba.beta_init = base.tba.beta_final = 0.1
    return make_config(base, argv)


def paced(algo, step_s: float):
    """`algo` whose trainer step takes at least `step_s` s more ($NODES_TOY_STEP_S): the toy step is
    ~40 ms, real ones take seconds, so transport delays weigh as they would in a real run."""
    if step_s <= 0:
        return algo
    inner = algo.minibatches

    def minibatches(model, batch, step):
        time.sleep(step_s)
        return inner(model, batch, step)
    algo.minibatches = minibatches
    return algo


def main(argv: list[str]) -> dict:
    cfg = config(argv)
    setup(cfg)
    # a fault in the first attempt only: a torchrun restart (--max-restarts) then runs clean
    die = os.environ.get("NODES_TOY_DIE_AFTER") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    reward = dying_reward if die else toy_reward
    algo = paced(make_algo(cfg), float(os.environ.get("NODES_TOY_STEP_S", "0")))
    if cfg.train.reward_workers:  # --train.reward_workers=R: scored in R reward workers per generating node
        return train(cfg, algo, _prompts(), None, stop_token_ids=(), resume=cfg.resume,
                     reward_factory=make_toy_batched_reward)
    return train(cfg, algo, _prompts(), reward, stop_token_ids=(), resume=cfg.resume)


if __name__ == "__main__":
    last = main(sys.argv[1:])
    print(f"[nodes_toy] done: version {last.get('version')}", flush=True)
