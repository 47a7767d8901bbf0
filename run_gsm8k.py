"""GSM8K with TBA, AReaL or the synchronous GRPO baseline: the script researchers edit and run.

    python run_gsm8k.py                              # TBA, CPU preset, SmolLM2-135M-Instruct, offline
    python run_gsm8k.py --algo=areal                 # AReaL: decoupled PPO, eta = 4, interruptible generation
    python run_gsm8k.py --preset=gpu                 # the paper's settings (7 prompts x 20, k=2)
    python run_gsm8k.py --preset=paper               # TBA's GSM8K run: RhoMath-1B SFT by hub id (paper_preset's table)
    python run_gsm8k.py --algo=areal --preset=areal_long  # AReaL's long reasoning: R1-Distill-Qwen-1.5B, 512 x 16
    python run_gsm8k.py --algo=grpo --train.mode=sync  # synchronous baseline, same code
    python run_gsm8k.py --help                       # every config key with its comment

What is here: the prompt (chat template, or the paper's "[MATH TASK]" template), the reward
(`reward_correct`, common/rewards/math_answer.py: the final answer, the later of the whole last \\boxed{...}
and GSM8K's '####' answer, plain numbers compared exactly, anything else by math-verify, bounded in
time; exactly 1 or 0, and 0 for a box cut at the token limit), the dataset
(`--data.source`: local jsonl, a `datasets` folder or the hub's openai/gsm8k; default: the
repository's copy in data/gsm8k), the config presets, the evaluation (greedy pass@1 on a fixed
test subset) and main(reward=, loss=). The trainer runs in this process; the generators get
`reward_fn` by reference when this module was imported (they import it), by value when it runs as
the main script (common/runtime/pickling.py).

Reward r(x, y) = 1[ answer(y) equals gold(x) ]; TBA's target is pi_ref(y|x) exp(r / beta).
Data rows are JSONL {"question": ..., "answer": "<reasoning>#### 42"}; the gold answer is the
text after the last '####' with thousands separators removed ("1,200" -> "1200").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from areal.algo import AReaLConfig
from common import task
from common.contracts.batch import PromptSet
from common.contracts.config_check import at_least, relation
from common.data import default_data_dir as find_data_dir
from common.data import load_examples, read_jsonl
from common.engine.checkpoints.hf_save import tokenizer_stop_ids
from common.contracts.errors import UserError
from common.evaluate import greedy_pass_at_1
from common.rewards.math_answer import extract_answer, normalise_number, reward_correct  # noqa: F401 - extract_answer: run_gsm8k.extract_answer stays
from common.runtime.generator import GenConfig
from common.runtime.train_config import TrainConfig
from tba.algo import TBAConfig

PAPER_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"
INSTRUCTION = "\nSolve step by step and give the final answer as a number after '####'."
PROMPT_STYLES = ("chat", "paper")


@dataclass
class GSM8KExample:
    question: str
    answer: str   # full reference solution, '#### gold' included
    gold: str     # normalised final answer, e.g. "1200"


# ---------------------------------------------------------------------------------------------
# data

def default_data_dir() -> Path:
    """The repository's GSM8K (data/gsm8k: train/test.jsonl.gz, MIT), or $ASYNCRL_DATA_DIR/gsm8k if that exists."""
    return find_data_dir("gsm8k")


HUB_DATASET = "openai/gsm8k"  # on the hub: configs "main" / "socratic", splits train / test, same fields


def example_from_row(row, where: str) -> GSM8KExample:
    """One {"question", "answer": "...#### 42"} row -> GSM8KExample; errors name `where`."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"{where}: missing or non-string key {key!r}")
    answer = row["answer"]
    if "####" not in answer:
        raise ValueError(f"{where}: answer has no '####' gold marker")
    gold = normalise_number(answer.rsplit("####", 1)[1].strip())
    if not gold:
        raise ValueError(f"{where}: empty gold answer after '####'")
    return GSM8KExample(question=row["question"], answer=answer, gold=gold)


def load_gsm8k(path, limit: int | None = None) -> list[GSM8KExample]:
    """Read a GSM8K JSONL file; errors name the file and the 1-based line number."""
    return read_jsonl(path, example_from_row, limit, hint="point the run at the right folder with "
                      f"--data.source=<folder with train/test.jsonl>, or a hub id such as {HUB_DATASET}")


def load_split(source: str, split: str, limit: int | None = None, hub_config: str | None = "main") -> list[GSM8KExample]:
    """`split` ("train" / "test") from a folder with <split>.jsonl, a `datasets` save_to_disk
    folder, or a hub id such as openai/gsm8k (with `hub_config`); see `common/data.py`."""
    return load_examples(source, split, example_from_row, limit, hub_config)


# ---------------------------------------------------------------------------------------------
# prompts

def format_prompt(question: str, tokenizer=None, style: str = "chat") -> str:
    """Prompt string for `question`. "chat": the tokenizer's chat template with INSTRUCTION
    appended to the user turn; "paper": PAPER_TEMPLATE (the TBA paper's raw-text prompt)."""
    if style == "paper":
        return PAPER_TEMPLATE.format(question=question)
    if style == "chat":
        if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError("format_prompt(style='chat') needs a tokenizer with apply_chat_template")
        return tokenizer.apply_chat_template([{"role": "user", "content": question + INSTRUCTION}],
                                             add_generation_prompt=True, tokenize=False)
    raise ValueError(f"format_prompt: unknown style {style!r}, expected one of {PROMPT_STYLES}")


def reward_fn(completion_text: str, gold: str) -> float:
    """The reward generators call: (decoded completion, this prompt's meta) -> float."""
    return reward_correct(completion_text, gold)


# ---------------------------------------------------------------------------------------------
# config: every field can be overridden from the command line (--section.field=value)

@dataclass
class DataConfig:
    source: str = str(default_data_dir())  # folder with train/test.jsonl(.gz) (default: the repo's data/gsm8k), a datasets save_to_disk folder, or a hub id (openai/gsm8k)
    hub_config: Optional[str] = "main"  # dataset config when source is a hub id (openai/gsm8k: main | socratic)
    prompt_style: Literal["chat", "paper"] = "chat"  # model's chat template, or the paper's [MATH TASK] template
    train_limit: Optional[int] = None   # use only the first N training problems
    eval_size: int = 128                # fixed test subset for greedy pass@1 (first N of test.jsonl); 0 = no evaluation
    eval_max_new_tokens: int = 256      # generation budget when evaluating
    eval_max_batch: int = 128           # sampler slots when evaluating (128 beat 32/64 on 2 CPU cores)
    max_prompt_tokens: Optional[int] = None  # training prompts longer than this are left out (AReaL's max_prompt_len); None = all

    CHECKS = {"train_limit": at_least(1), "eval_size": at_least(0), "eval_max_new_tokens": at_least(1),
              "eval_max_batch": at_least(1), "max_prompt_tokens": at_least(1)}  # ranges (common/contracts/config_check.py)


@dataclass
class GSM8KConfig(task.RunConfig):
    name: str = "gsm8k_tba"             # run directory name under run_root
    # CPU preset (run times measured on 2-core boxes: BENCHMARKS.md, "TBA on GSM8K"): 2 prompts x 4
    # samples per step (~2.6k tokens), 40 steps, paper lr and beta schedule compressed to 40 steps.
    gen: GenConfig = field(default_factory=lambda: GenConfig(max_batch=32, max_new_tokens=192, n=4))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        steps=40, lr=1e-5, warmup_steps=2, prompts_per_step=2, sync_every=2, min_buffer=8,
        buffer_capacity=2048, micro_batch_tokens=4096, checkpoint_every=10, eval_every=0))
    tba: TBAConfig = field(default_factory=lambda: TBAConfig(beta_anneal_steps=40))
    data: DataConfig = field(default_factory=DataConfig)

    CHECKS = {"algo": relation(lambda v, c: c.preset not in ("areal_long", "areal_eta") or v == "areal",  # RunConfig's kept
                               "'areal' with --preset={s.preset} (AReaL's settings: decoupled PPO, no reference)")}


def gpu_preset(cfg: GSM8KConfig) -> GSM8KConfig:
    """The paper's GSM8K settings (TBA paper, Bartoldson et al. 2025): 7 prompts x K=20, k=2, m=0.95, lr 1e-5."""
    cfg.gen = GenConfig(max_batch=256, max_new_tokens=512, n=20, temperature=0.7)
    cfg.train = TrainConfig(steps=1000, lr=1e-5, warmup_steps=50, decay_steps=200, prompts_per_step=7,
                            sync_every=2, min_buffer=500, buffer_capacity=65536, micro_batch_tokens=32768,
                            checkpoint_every=100, eval_every=100)
    cfg.tba = TBAConfig(beta_init=0.012, beta_final=0.004, beta_anneal_steps=500, m=0.95)
    cfg.data.eval_size, cfg.data.eval_max_new_tokens = 1319, 512
    return task.gpu_defaults(cfg)


R1_DISTILL_1_5B = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"  # AReaL's 1.5B long-reasoning policy (hub id, ~3.5 GB)
GSM8K_TRAIN_SIZE = 7473  # problems in GSM8K's train split


def areal_long_preset(cfg: GSM8KConfig) -> GSM8KConfig:
    """AReaL's long-reasoning math run (Fu et al. 2025, R1-Distill-Qwen-1.5B) on GSM8K, as its code
    has it (AReaL v0.3.0: training/configs/async-ppo.yaml and realhf's PPO interface): 512 prompts x
    16 answers of up to 27,648 tokens at temperature 1; decoupled PPO, eps 0.2, 4 minibatches, no
    behaviour-weight cap, a micro-batch whose mean pi/pi_prox exceeds 5 dropped, the reward +-5
    (clip 20) normalised over the batch's tokens, eta 4; Adam lr 2e-5 constant after 0.1% of the
    steps, betas (0.9, 0.95), eps 1e-5, weight decay 0.05, grad clip 1; prompts over 1,024 tokens
    left out. It implies --algo=areal (`task.areal_defaults`: k = 1, interruptible generation, no
    reference). Each setting beside AReaL's, with its file: docs/tasks.md, "Paper presets"."""
    cfg.algo, cfg.model, cfg.ref_model, cfg.name = "areal", R1_DISTILL_1_5B, None, "gsm8k_areal_long"
    # the KV cache is paged (gen.kv_layout): its pool, sized from the GPU's free memory when the generator
    # starts (gen.kv_tokens=0; 28 KiB a token in bf16: 28 layers x 2 KV heads x 128 x K,V), holds the tokens
    # that are live, so 256 slots bound rows, not memory; past the pool the youngest samples are preempted
    cfg.gen = GenConfig(max_batch=256, max_new_tokens=27648, n=16, temperature=1.0, top_p=1.0, top_k=0,
                        update_mode="interrupt", ref_logp=False, kv_layout="paged", kv_tokens=0)
    cfg.train = TrainConfig(
        steps=math.ceil(5 * GSM8K_TRAIN_SIZE / 512), lr=2e-5, warmup_steps=0, warmup_fraction=0.001,
        lr_schedule="constant", decay_steps=0, weight_decay=0.05, adam_beta2=0.95, adam_eps=1e-5, grad_clip=1.0,
        prompts_per_step=512, sync_every=1, max_staleness=4, min_buffer=512 * 16,
        buffer_capacity=65536,  # >= (eta + 1) x 512 x 16 = 40,960 trajectories in flight
        micro_batch_tokens=30720, checkpoint_every=10, eval_every=25)
    cfg.areal = AReaLConfig(eps_clip=0.2, eps_clip_high=None, behav_imp_weight_cap=None, n_minibatches=4,
                            adv_norm="batch_tokens", early_stop_imp_ratio=5.0, mask_too_long=False,
                            reward_bias=0.5, reward_scaling=10.0, max_reward_clip=20.0)
    cfg.data.max_prompt_tokens = 1024
    # greedy pass@1 on the whole test set, with the training budget (a long reasoning cut short scores 0)
    cfg.data.eval_size, cfg.data.eval_max_new_tokens, cfg.data.eval_max_batch = 1319, 27648, 32
    return task.gpu_defaults(cfg)


def areal_eta_preset(cfg: GSM8KConfig) -> GSM8KConfig:
    """AReaL's staleness ablation (its blog v0.3, Table 3: eta in {0, 1, 2, 4, 8, 16, inf}, naive vs
    decoupled PPO, AIME24/25): `areal_long`'s run at 8,192 new tokens, 512 x 16, 4 minibatches, lr
    2e-5, 1,000 PPO updates, on R1-Distill-Qwen-1.5B. Set eta with --train.max_staleness; the naive
    arm is a loss (areal.loss.ppo_loss), as `python bench/staleness.py --preset areal_eta` sweeps them."""
    cfg = areal_long_preset(cfg)
    cfg.name, cfg.gen.max_new_tokens, cfg.train.steps = "gsm8k_areal_eta", 8192, 1000
    cfg.data.eval_max_new_tokens, cfg.data.eval_max_batch = 8192, 128
    return cfg


RHO_1B_SFT = "realtreetune/rho-1b-sft-GSM8K"  # TBA's GSM8K policy and reference: RhoMath-1B SFT on GSM8K (a 1.1B Llama)


def paper_preset(cfg: GSM8KConfig) -> GSM8KConfig:
    """TBA's GSM8K run, read from its code (github.com/bbartoldson/TBA: configs/tba_rho1b_gsm8k.yml,
    launch_training_gsm8k.sh, src/tba_trainer_gsm8k.py and the TRL 0.9.4 / transformers 4.43
    defaults it inherits): RhoMath-1B SFT as policy and reference, the "[MATH TASK]" prompt, 7
    prompts x K = 20, 700 steps, T = 0.7 and <= 512 tokens; lr 1e-5 warmup-stable-decay (50 warm-up,
    350 stable, a cosine decay over 600 that the run cuts at step 700: it ends at 5e-6), AdamW betas
    (0.9, 0.999), eps 1e-8, no weight decay, no grad clipping; beta 0.014 -> 0.004 over 500 steps, k =
    2, m = 0.95 with uniform replay over a prompt's newest 100, 500 samples before training, greedy
    eval on the 1,319 test problems. Each setting beside TBA's: docs/tasks.md, "Paper presets".
    Needs the hub (or the checkpoint by path) and a GPU; `--random_weights` builds its shape locally."""
    cfg.model, cfg.ref_model, cfg.name = RHO_1B_SFT, None, "gsm8k_paper"
    cfg.data.prompt_style = "paper"
    cfg.gen = GenConfig(max_batch=256, max_new_tokens=512, n=20, temperature=0.7, top_p=1.0, top_k=0)
    cfg.train = TrainConfig(steps=700, lr=1e-5, warmup_steps=50, stable_steps=350, decay_steps=600,
                            lr_schedule="cosine", weight_decay=0.0, adam_beta2=0.999, adam_eps=1e-8, grad_clip=0.0,
                            prompts_per_step=7, sync_every=2, min_buffer=500, buffer_capacity=65536,
                            micro_batch_tokens=32768, checkpoint_every=175, eval_every=0)
    cfg.tba = TBAConfig(beta_init=0.014, beta_final=0.004, beta_anneal_steps=500, m=0.95, sampling="uniform",
                        inv_temp=0.0, max_per_group=100)
    cfg.data.eval_size, cfg.data.eval_max_new_tokens, cfg.data.eval_max_batch = 1319, 512, 128
    return task.gpu_defaults(cfg)


def make_config(argv: list[str] | None = None) -> GSM8KConfig:
    """Defaults, then the preset, then the algorithm's defaults, then every other override."""
    return task.make_config(GSM8KConfig(), argv, presets={"gpu": gpu_preset, "paper": paper_preset,
                                                          "areal_long": areal_long_preset, "areal_eta": areal_eta_preset},
                            description=__doc__)


# ---------------------------------------------------------------------------------------------
# main

def tokenize_prompts(examples, tokenizer, style: str) -> list[list[int]]:
    """Token ids of each prompt; the paper's raw-text template gets the tokenizer's special tokens
    (a Llama tokenizer's BOS, as TBA tokenises it), a chat template already holds its own."""
    return [tokenizer(format_prompt(ex.question, tokenizer, style), add_special_tokens=style == "paper")["input_ids"]
            for ex in examples]


def main(argv: list[str] | None = None, reward=None, loss=None) -> dict:
    """Run the task; returns the last metrics. `reward`: None (`reward_fn`: 1 when the final answer
    equals the gold one), fn(text, gold) -> float, or a factory for reward workers
    (`task.split_reward`); evaluation keeps the task's own grader. `loss`: a loss function or an
    Algorithm for `task.run` (None: the algorithm's own)."""
    cfg = make_config(argv)
    task.setup(cfg)
    train_ex = load_split(cfg.data.source, "train", cfg.data.train_limit, cfg.data.hub_config)  # data errors first:
    test_ex = load_split(cfg.data.source, "test", cfg.data.eval_size, cfg.data.hub_config)  # they take a second
    tok = task.tokenizer_of(cfg)
    tokens = tokenize_prompts(train_ex, tok, cfg.data.prompt_style)
    keep = [i for i, t in enumerate(tokens) if cfg.data.max_prompt_tokens is None or len(t) <= cfg.data.max_prompt_tokens]
    if len(keep) < len(tokens):  # AReaL drops them (it does not cut them)
        print(f"[gsm8k] {len(tokens) - len(keep)} of {len(tokens)} training prompts are over "
              f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} tokens: left out")
    if not keep:
        raise UserError(f"no training prompt fits --data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    prompts = PromptSet([tokens[i] for i in keep], [train_ex[i].gold for i in keep])
    eval_prompts = tokenize_prompts(test_ex, tok, cfg.data.prompt_style)
    stops = tokenizer_stop_ids(tok)  # EOS and the chat template's end of turn

    def evaluate(model, tokenizer):
        return greedy_pass_at_1(model, tokenizer, eval_prompts, [ex.gold for ex in test_ex], reward_fn,
                                cfg.data.eval_max_new_tokens, stops, max_batch=cfg.data.eval_max_batch)

    fn, factory = task.split_reward(reward) if reward is not None else (reward_fn, None)
    return task.run(cfg, prompts, fn, stops, evaluate=evaluate if cfg.data.eval_size else None, title="GSM8K",
                    reward_factory=factory, loss=loss)


if __name__ == "__main__":
    task.script(main)
