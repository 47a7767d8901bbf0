"""TL;DR summarisation with TBA, AReaL or the GRPO baseline: the script researchers edit and run.

    python run_tldr.py                     # TBA, CPU preset, SmolLM2-135M-Instruct, offline reward models
    python run_tldr.py train-rm            # (re)train the two offline reward models, report held-out accuracy
    python run_tldr.py --reward.model=/path/to/pythia-rm --reward.gold_model=/path/to/bigger-rm
    python run_tldr.py --algo=areal        # or --algo=grpo; --train.mode=sync: the synchronous baseline
    python run_tldr.py --preset=gpu        # the paper's batch: 8 prompts x 20, 128 new tokens, 256 steps
    python run_tldr.py --preset=paper      # TBA's TL;DR run: Pythia SFT policy and RMs by hub id (table below)
    python run_tldr.py --preset=paper --print-config   # the resolved config, nothing loaded
    python run_tldr.py --help              # every config key with its comment

What is here: the data (`--data.source`: a folder with train/val.jsonl rows {"document": [sentences],
"summary"}, a `datasets` folder, or a hub id whose rows have post/prompt and summary/completion
fields, e.g. trl-lib/tldr), the prompt (the post, truncated on a sentence boundary to
`data.max_post_tokens`, in the model's chat template with a summarisation instruction, or the
papers' "<post>\\nTL;DR:"), the evaluation, presets, main(). The reward models (scoring, and
training the offline ones) are common/rewards/tldr.py's.

Reward: r(x, y) = RM(post, summary), the scalar head of any Hugging Face sequence-classification
reward model (`common/rewards/reward_model.py`), run batched in reward-worker processes; a summary cut at
`gen.max_new_tokens` without EOS gets `gen.no_stop_reward` (paper: -1) instead. TBA's target is
pi_ref(y|x) exp(r / beta). Offline default RMs: MiniLM cross-encoders fine-tuned with the
Bradley-Terry loss on pairs built from the local sample (`train-rm`): the true TL;DR is preferred
over another post's TL;DR, the post's lead sentence, a truncated and a shuffled TL;DR. The policy
RM sees the first half of the training posts, the "gold" RM (evaluation only, as the papers judge
with a larger RM) the second half, with another seed.

Evaluation (before, every `train.eval_every` steps, after), on a fixed set of validation posts:
win-rate = fraction of posts where the gold RM scores the policy's greedy summary above the
reference TL;DR (ties: identical text, or scores within 1e-4, count 1/2); KL = mean over posts of
log pi(y|x) - log pi_ref(y|x) of those summaries, at the sampling temperature; the reference
model's perplexity of them; mean length. The run ends with the win-rate change and its paired 95%
bootstrap interval (runs/<name>/eval_summary.json).

`--preset=paper`: TBA's TL;DR settings, read from its code (github.com/bbartoldson/TBA:
configs/tba_pythia2.8b_tldr.yml, launch_training_tldr.sh, src/tba_trainer_tldr.py and the TRL
RLOO/on-policy defaults it inherits). Needs the hub (or the checkpoints by path) and a GPU.
    setting              TBA's code                                        here
    policy = reference   mnoukhov/pythia{410m,1b,2.8b}-sft-tldr (launch: 1b) --model (1b), ref_model = it
    reward model         mnoukhov/pythia{size}-rm-tldr6.9b                 --reward.model (text input)
    gold RM (eval)       cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr  --reward.gold_model
    data                 vwxyzjn/summarize_from_feedback_tldr_3_filtered_    --data.source, eval split
                         oai_preprocessing_1706381144, eval: validation    validation
    prompt               the dataset's query (subreddit, title, post,      "<post>\nTL;DR:", posts cut
                         "TL;DR:"), <= 512 tokens                          to 512 tokens
    batch                8 prompts x K = 20 (20 per device x 8 accum.)     prompts_per_step 8, gen.n 20
    steps, lr            256 (40,960 episodes / 160), 3e-6 linear to 0,    256, lr 3e-6, decay_steps 256,
                         no warm-up                                        warmup 0
    beta (kl_coef)       1.0 towards 0.05 at step 128, cut to 0.05 at 32   tba.beta 1.0 -> 0.05, anneal
                                                                           128, beta_cut_step 32
    sampling             T = 0.7, <= 128 tokens, EOS stops; no EOS:        gen: 0.7, 128, no_stop_reward -1
                         reward -1
    replay               m = 0.5 (on_policy_prob), softmax(reward) over    tba.m 0.5, sampling reward,
                         <= 100 newest per prompt, 10,000 samples first    inv_temp 1, min_buffer 10000
    sync                 every 10 trainer steps                            train.sync_every 10
    hardware, precision  4 A100: 1 trainer + 3 searchers (vLLM), fp16      GPU preset, precision auto (bf16)
    evaluation           greedy (T = 0.01), 128 tokens, gold RM win-rate   eval greedy, 128 tokens, 512 posts
Not reproduced: the query's subreddit and title (our loader keeps the post text), vLLM searchers.
"""
from __future__ import annotations

import functools
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from common import task
from common.contracts.batch import PromptSet
from common.contracts.config_check import at_least
from common.data import default_data_dir, load_examples
from common.engine.checkpoints.hf_io import load_model
from common.engine.checkpoints.hf_save import tokenizer_stop_ids
from common.evaluate import bootstrap_diff, completion_logps, greedy_completions, win_vector
from common.rewards.reward_model import RewardModel
from common.contracts.run_files import record
from common.runtime.generator import GenConfig
from common.runtime.train_config import TrainConfig
from tba.algo import TBAConfig
from common.rewards.tldr import (RM_DTYPES, RewardConfig, RMTrainConfig, make_rm_reward, resolve_rm, rm_prompts,
                               train_offline_rms)

HUB_DATASET = "trl-lib/tldr"  # rows {"prompt": "SUBREDDIT: ... POST: ... TL;DR:", "completion": " ..."}
INSTRUCTION = "Summarize this Reddit post in one sentence."


@dataclass
class TLDRExample:
    sentences: list[str]  # the post, sentence by sentence
    summary: str          # the author's TL;DR (the reference)


# ------------------------------------------------------------------------------------------ data
_SENT = re.compile(r"(?<=[.!?])\s+")


def example_from_row(row, where: str) -> TLDRExample:
    """A row with the post (`document`: list of sentences or text, or `post` / `content` /
    `prompt`) and its TL;DR (`summary` / `completion` / `label`) -> TLDRExample."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    post = next((row[k] for k in ("document", "post", "content", "prompt") if k in row), None)
    summary = next((row[k] for k in ("summary", "completion", "label") if k in row), None)
    if isinstance(post, str):
        post = post.strip().removesuffix("TL;DR:").strip()
        post = [s for s in _SENT.split(post) if s.strip()]
    if not (isinstance(post, list) and post and all(isinstance(s, str) for s in post)):
        raise ValueError(f"{where}: no post (a non-empty 'document' list of sentences, or 'post' / 'prompt' text)")
    if not (isinstance(summary, str) and summary.strip()):
        raise ValueError(f"{where}: missing or empty 'summary' (or 'completion' / 'label')")
    return TLDRExample(sentences=[s.strip() for s in post], summary=summary.strip())


def load_split(source: str, split: str, limit: int | None = None, hub_config: str | None = None) -> list[TLDRExample]:
    return load_examples(source, split, example_from_row, limit, hub_config)


def truncate_post(sentences: list[str], tokenizer, max_tokens: int) -> str:
    """The leading sentences that fit `max_tokens` tokens (at least the first, cut to fit)."""
    out, n = [], 0
    for s in sentences:
        k = len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
        if n + k > max_tokens:
            break
        out.append(s)
        n += k
    if not out:
        return tokenizer.decode(tokenizer(sentences[0], add_special_tokens=False)["input_ids"][:max_tokens])
    return " ".join(out)


def format_prompt(post: str, tokenizer, style: str = "chat") -> str:
    if style == "paper":
        return f"{post}\nTL;DR:"
    return tokenizer.apply_chat_template([{"role": "user", "content": f"{INSTRUCTION}\n\n{post}"}],
                                         add_generation_prompt=True, tokenize=False)


# ---------------------------------------------------------------------------------------- config
@dataclass
class DataConfig:
    source: str = str(default_data_dir("tldr"))  # folder with <split>.jsonl(.gz) (default: the repo's data/tldr sample), a datasets folder, or a hub id
    hub_config: Optional[str] = None    # dataset config when source is a hub id
    train_split: str = "train"          # split the policy trains on (and the RMs are built from)
    eval_split: str = "val"             # split of the fixed evaluation posts (trl-lib/tldr: validation)
    prompt_style: Literal["chat", "paper"] = "chat"  # chat template + instruction, or the papers' "<post>\nTL;DR:"
    max_post_tokens: int = 192          # posts truncated on a sentence boundary to this many policy tokens
    train_limit: Optional[int] = None   # use only the first N training posts
    eval_size: int = 128                # fixed validation posts for win-rate / KL (first N; 64 gave a 95% CI of +-0.11); 0 = no evaluation
    eval_max_new_tokens: int = 64       # summary budget when evaluating
    eval_max_batch: int = 64            # sampler slots when evaluating

    CHECKS = {"max_post_tokens": at_least(1), "train_limit": at_least(1), "eval_size": at_least(0),
              "eval_max_new_tokens": at_least(1), "eval_max_batch": at_least(1)}  # ranges (common/contracts/config_check.py)


@dataclass
class TLDRConfig(task.RunConfig):
    name: str = "tldr_tba"              # run directory name under run_root
    # CPU preset (run times, RM training included: BENCHMARKS.md, "TL;DR"): 2 posts x 4 summaries of
    # <= 64 tokens per step, 48 steps; the paper's beta 1.0 -> 0.05 dropping by step 32 of 256, scaled to step 16
    gen: GenConfig = field(default_factory=lambda: GenConfig(max_batch=16, max_new_tokens=64, n=4, temperature=0.7,
                                                             no_stop_reward=-1.0))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        steps=48, lr=1e-5, warmup_steps=2, prompts_per_step=2, sync_every=2, min_buffer=8, buffer_capacity=4096,
        micro_batch_tokens=4096, reward_workers=1, checkpoint_every=16, eval_every=0))
    tba: TBAConfig = field(default_factory=lambda: TBAConfig(beta_init=1.0, beta_final=0.05, beta_anneal_steps=16,
                                                             m=0.5, sampling="reward"))
    data: DataConfig = field(default_factory=DataConfig)

    def reward_worker_models(self) -> tuple[str, ...]:
        return ("reward.model",)

    def evaluation_models(self) -> tuple[str, ...]:  # the gold RM judges, the initial policy gives the KL
        return ("reward.gold_model", "ref_model") if self.data.eval_size else ()
    reward: RewardConfig = field(default_factory=RewardConfig)
    rm: RMTrainConfig = field(default_factory=RMTrainConfig)


def gpu_preset(cfg: TLDRConfig) -> TLDRConfig:
    """The paper's TL;DR settings (TBA paper, Bartoldson et al. 2025): 8 prompts x 20, 128 tokens, T = 0.7,
    lr 3e-6, k = 10, 256 steps, beta 1.0 -> 0.05 by step 32, m = 0.5, softmax(reward) sampling."""
    cfg.gen = GenConfig(max_batch=256, max_new_tokens=128, n=20, temperature=0.7, no_stop_reward=-1.0)
    cfg.train = TrainConfig(steps=256, lr=3e-6, warmup_steps=10, prompts_per_step=8, sync_every=10, min_buffer=160,
                            buffer_capacity=65536, micro_batch_tokens=32768, reward_workers=1, checkpoint_every=64,
                            eval_every=32)
    cfg.tba = TBAConfig(beta_init=1.0, beta_final=0.05, beta_anneal_steps=32, m=0.5, sampling="reward")
    cfg.data.max_post_tokens, cfg.data.eval_size, cfg.data.eval_max_new_tokens = 512, 512, 128
    cfg.reward.device = "cuda"
    return task.gpu_defaults(cfg)


PAPER_POLICY = "mnoukhov/pythia1b-sft-tldr"  # TBA's launch script default size; 410m and 2.8b likewise
PAPER_RM = "mnoukhov/pythia1b-rm-tldr6.9b"   # the size-matched RM trained on the 6.9B gold RM's labels
PAPER_GOLD = "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr"
PAPER_DATA = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"


def paper_preset(cfg: TLDRConfig) -> TLDRConfig:
    """TBA's TL;DR run (docs/tasks.md's table): the GPU preset's batch with the paper's checkpoints,
    data, lr schedule (linear to 0 over the run, no warm-up), AdamW as transformers' defaults have it
    (betas (0.9, 0.999), eps 1e-8), no gradient clipping (TBA's loop never clips), beta cut and
    initial buffer."""
    cfg = gpu_preset(cfg)
    cfg.model, cfg.ref_model = PAPER_POLICY, None
    cfg.reward.model, cfg.reward.gold_model, cfg.reward.input = PAPER_RM, PAPER_GOLD, "text"
    cfg.data.source, cfg.data.eval_split, cfg.data.prompt_style = PAPER_DATA, "validation", "paper"
    cfg.train.warmup_steps, cfg.train.decay_steps, cfg.train.min_buffer = 0, 256, 10_000
    cfg.train.lr_schedule, cfg.train.stable_steps, cfg.train.grad_clip = "linear", None, 0.0
    cfg.train.adam_beta2, cfg.train.adam_eps, cfg.train.weight_decay = 0.999, 1e-8, 0.0
    cfg.tba = TBAConfig(beta_init=1.0, beta_final=0.05, beta_anneal_steps=128, beta_cut_step=32, m=0.5,
                        sampling="reward", inv_temp=1.0, max_per_group=100)
    cfg.name = "tldr_paper"
    return cfg


def make_config(argv: list[str] | None = None) -> TLDRConfig:
    return task.make_config(TLDRConfig(), argv, presets={"gpu": gpu_preset, "paper": paper_preset}, description=__doc__)


def train_rms(cfg: TLDRConfig) -> dict:
    """`train-rm`: the offline reward models (common/rewards/tldr.py) from the first `data.train_limit`
    training posts, their pair accuracy on `rm.eval_posts` held-out posts of the eval split."""
    train_ex = load_split(cfg.data.source, cfg.data.train_split, cfg.data.train_limit, cfg.data.hub_config)
    val_ex = load_split(cfg.data.source, cfg.data.eval_split, cfg.rm.eval_posts, cfg.data.hub_config)
    return train_offline_rms(train_ex, val_ex, cfg.rm, cfg.reward.max_tokens)


# ------------------------------------------------------------------------------------ evaluation
class Evaluator:
    """Win-rate against the reference TL;DRs under the gold RM, KL to the reference policy,
    reference perplexity and length, on fixed posts; keeps every evaluation's per-post wins."""

    def __init__(self, cfg: TLDRConfig, prompts: list[list[int]], posts: list[str], refs: list[str], stops: tuple,
                 gold_path: str):
        self.cfg, self.prompts, self.posts, self.refs, self.stops, self.gold_path = cfg, prompts, posts, refs, stops, gold_path
        self.gold = self.ref_model = None
        self.wins: list[list[float]] = []

    def __call__(self, model, tokenizer) -> dict:
        c = self.cfg
        if self.gold is None:  # loaded on first use, kept for the run
            self.gold = RewardModel(self.gold_path, device=c.reward.device, max_tokens=c.reward.max_tokens,
                                    batch_size=c.reward.batch_size, input=c.reward.input, dtype=RM_DTYPES[c.reward.dtype])
            self.ref_model = load_model(c.ref_model or c.model, device=model.device, dtype=model.dtype,
                                        tokenizer=False)[0].eval()  # beside the policy, in its dtype
        outs = greedy_completions(model, self.prompts, c.data.eval_max_new_tokens, self.stops, c.data.eval_max_batch)
        summ = [tokenizer.decode(o.tokens, skip_special_tokens=True).strip() for o in outs]
        ctx = rm_prompts(self.gold, self.posts)
        gold_pol, gold_ref = self.gold.score(ctx, summ), self.gold.score(ctx, self.refs)
        wins = win_vector(gold_pol, gold_ref, summ, self.refs)
        self.wins.append(wins)
        lp = completion_logps(model, outs, c.gen.temperature)
        lr = completion_logps(self.ref_model, outs, c.gen.temperature)
        n_tok = sum(len(o.tokens) for o in outs)
        return {"eval_win_rate": sum(wins) / len(wins), "eval_kl": sum(a - b for a, b in zip(lp, lr)) / len(lp),
                "eval_ref_ppl": math.exp(-sum(lr) / n_tok), "eval_len": n_tok / len(outs),
                "eval_no_eos": sum(o.finish_reason == "length" for o in outs) / len(outs),
                "eval_gold_reward": sum(gold_pol) / len(gold_pol), "eval_n": len(outs)}


PANELS = (("reward_mean", "train reward (policy RM)"), ("eval_win_rate", "win-rate vs reference (gold RM)"),
          ("eval_kl", "KL to reference (nats / summary)"), ("staleness_mean", "staleness (versions behind)"))


def main(argv: list[str] | None = None, reward=None, loss=None) -> dict:
    """Run the task; returns the last metrics. `reward`: None (the policy reward model, in reward
    workers), fn(summary, post) -> float, or a factory for reward workers (`task.split_reward`);
    evaluation keeps the gold reward model. `loss`: a loss function or an Algorithm for
    `task.run` (None: the algorithm's own)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train-rm"]:
        cfg = make_config(argv[1:])
        task.setup(cfg)
        return train_rms(cfg)
    cfg = make_config(argv)
    if reward is None and cfg.train.reward_workers < 1:
        raise ValueError("TL;DR scores with a reward model in reward-worker processes: --train.reward_workers >= 1")
    task.setup(cfg)
    train_ex = load_split(cfg.data.source, cfg.data.train_split, cfg.data.train_limit, cfg.data.hub_config)
    eval_ex = load_split(cfg.data.source, cfg.data.eval_split, cfg.data.eval_size, cfg.data.hub_config)
    # reward models only where they are used: the policy RM for the task's own reward, the gold RM to evaluate
    rm_path = resolve_rm(cfg.reward.model, "policy", lambda: train_rms(cfg)) if reward is None else None
    gold_path = resolve_rm(cfg.reward.gold_model, "gold", lambda: train_rms(cfg)) if cfg.data.eval_size else None
    tok = task.tokenizer_of(cfg)

    def encode(examples):
        posts = [truncate_post(ex.sentences, tok, cfg.data.max_post_tokens) for ex in examples]
        return posts, [tok(format_prompt(p, tok, cfg.data.prompt_style), add_special_tokens=False)["input_ids"]
                       for p in posts]
    posts, tokens = encode(train_ex)
    eval_posts, eval_tokens = encode(eval_ex)
    stops = tokenizer_stop_ids(tok)
    evaluate = Evaluator(cfg, eval_tokens, eval_posts, [ex.summary for ex in eval_ex], stops, gold_path)
    fn, factory = task.split_reward(reward) if reward is not None else (None, functools.partial(
        make_rm_reward, rm_path, cfg.reward.input, cfg.reward.max_tokens, cfg.reward.batch_size, cfg.reward.device,
        cfg.reward.dtype))
    last = task.run(cfg, PromptSet(tokens, posts), fn, stops, evaluate=evaluate if cfg.data.eval_size else None,
                    reward_factory=factory, title="TL;DR", panels=PANELS, loss=loss)
    if len(evaluate.wins) >= 2:  # the change from before training to after, paired over the same posts
        s = bootstrap_diff(evaluate.wins[0], evaluate.wins[-1], seed=cfg.seed)
        out = Path(cfg.run_root) / cfg.name / "eval_summary.json"
        record(out)  # in the run folder: ours (common/contracts/run_files.py)
        out.write_text(json.dumps({"win_rate": s, "reward_model": rm_path or "the reward passed to main",
                                   "gold_model": gold_path}, indent=2) + "\n")
        print(f"[tldr] win-rate vs reference (gold RM, {s['n']} posts): before {s['before']:.3f}, after "
              f"{s['after']:.3f}, change {s['diff']:+.3f} (95% bootstrap CI {s['ci_low']:+.3f} .. {s['ci_high']:+.3f})")
        last["win_rate_change"] = s
    return last


if __name__ == "__main__":
    task.script(main)
