"""A simulated-clock AReaL run (one arm, one seed): a real policy trained by the real losses, with
time taken from a cost model instead of this machine's clock, so arms compare deterministically.
Run in-process by bench/staleness_judge.py and tests; nothing here spawns processes.

What is real: the policy (embeddings of (prompt id, previous token) -> MLP -> logits over `vocab`
tokens, shared parameters, AdamW), sampling at temperature 1, the reward (fraction of answer tokens
in a prompt's target set of `target` tokens: a random policy scores target / vocab), the admission
rule (`common.runtime.generator.Control`: started < (eta + v + 1) x P + dropped groups), the trainer's oldest-first
filter (a row whose oldest token is more than filter_eta versions old is dropped), the prox pass,
`areal.loss.behaviour_stats`, group-normalised advantages, `split_by_tokens` minibatches and the
loss (`decoupled_ppo_loss` or `ppo_loss`), and the staleness controller.
What is modelled (`SimConfig`, simulated seconds):
  lengths   per sample lognormal: L = clip(ceil(exp(len_mu + len_sigma z)), 1, max_len), drawn
            independently of the policy (common random numbers: the same per seed in every arm);
  decode    a tick costs tick_a + tick_b x active and gives each of the <= slots active samples one
            token, drawn by the version the generator holds; a published version is applied at the
            next tick ("interrupt": in-flight samples continue, each token keeps its version); a
            prompt is claimed as a group of n samples when n slots are free and `Control` admits it;
  training  a step costs train_c0 + train_c1 x (completion tokens of the batch); its weights are
            published (version + 1) when that cost has elapsed.
wait_share of a step = wait / (wait + train cost), wait = time from the last publish to a full batch.
The evaluation is exact, not sampled: the expected reward of the policy over all task prompts under
the length distribution, by propagating each prompt's token distribution through the Markov chain
(prompt, previous token) -> next token, so evaluated curves carry no sampling noise.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
from torch import nn

from areal.algo import split_by_tokens
from areal.loss import behaviour_stats, decoupled_ppo_loss, ppo_loss
from common.contracts.ops import group_normalised_advantages
from common.runtime.generator import Control
from common.runtime.staleness_control import ControlSettings, StalenessController

LOSSES = {"decoupled": decoupled_ppo_loss, "naive": ppo_loss}


@dataclass
class SimConfig:
    loss: str = "decoupled"   # decoupled | naive
    lr: float = 3e-3
    steps: int = 60           # trainer steps: every arm trains on steps x prompts x n rows
    max_eta: int = 8          # the largest eta (or ceiling) of any arm: sizes the random streams alike for all
    prompts: int = 4          # P, prompts per trainer step
    n: int = 8                # samples per prompt (a group)
    slots: int = 128          # M, concurrent samples in the generator
    vocab: int = 32
    target: int = 8           # target-set size per prompt
    task_prompts: int = 16
    len_mu: float = math.log(8.0)
    len_sigma: float = 0.75
    max_len: int = 32
    tick_a: float = 1.0       # decode tick: tick_a + tick_b x active simulated seconds
    tick_b: float = 0.02
    train_c0: float = 10.0    # trainer step: train_c0 + train_c1 x tokens simulated seconds
    train_c1: float = 0.02
    n_minibatches: int = 4
    eps_clip: float = 0.2
    cap: float = 5.0          # behav_imp_weight_cap
    d: int = 32               # embedding width
    hidden: int = 64


class Policy(nn.Module):
    """logits(prompt p, previous token x) = MLP(E_p[p] + E_x[x]); x = vocab is the start token."""
    def __init__(self, task_prompts: int, vocab: int, d: int, hidden: int):
        super().__init__()
        self.ep, self.ex = nn.Embedding(task_prompts, d), nn.Embedding(vocab + 1, d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, vocab))

    def table(self) -> torch.Tensor:
        """(task_prompts, vocab + 1, vocab) log-probs of every context: the generator samples from
        it and the trainer gathers from it, so on-policy log-probs are bit-identical in both."""
        return torch.log_softmax(self.mlp(self.ep.weight[:, None] + self.ex.weight[None]), -1)


def length_pmf(c: SimConfig) -> torch.Tensor:
    """P(L = l) for l = 1..max_len under the clipped, ceiled lognormal (index 0 is l = 1)."""
    cdf = lambda x: 0.5 * (1 + math.erf((math.log(x) - c.len_mu) / (c.len_sigma * math.sqrt(2))))  # noqa: E731
    edges = [0.0] + [cdf(l) for l in range(1, c.max_len)] + [1.0]
    return torch.tensor([b - a for a, b in zip(edges, edges[1:])], dtype=torch.float64)


@torch.no_grad()
def expected_reward(logp_table: torch.Tensor, target: torch.Tensor, pmf: torch.Tensor) -> float:
    """E[reward] over all task prompts and lengths: token t counts 1/L for every L > t, so its
    weight is sum_{l > t} pmf(l) / l; the token distribution q_t follows the chain."""
    p = logp_table.double().exp()
    V = p.shape[-1]
    w = (pmf / torch.arange(1, len(pmf) + 1)).flip(0).cumsum(0).flip(0)
    q, total = p[:, V], torch.zeros(p.shape[0], dtype=torch.float64)
    for t in range(len(pmf)):
        total += w[t] * (q * target).sum(-1)
        q = torch.bmm(q[:, None], p[:, :V]).squeeze(1)
    return float(total.mean())


def run_arm(c: SimConfig, arm, seed: int, settings: ControlSettings | None = None) -> dict:
    """One arm: arm is an int (fixed eta), "auto" or "auto+lr". Returns per-step rows, evaluations
    [(time, version, reward)] and summary figures; deterministic per (c, arm, seed)."""
    settings = settings or ControlSettings(ceiling=8)
    auto = isinstance(arm, str)
    ctl = StalenessController(settings) if auto else None
    eta = ctl.eta if auto else int(arm)
    filter_eta = settings.ceiling if auto else eta  # auto never drops a row admitted under a larger bound
    P, n, V, B = c.prompts, c.n, c.vocab, c.prompts * c.n
    g = torch.Generator().manual_seed(seed)
    target = torch.zeros(c.task_prompts, V, dtype=torch.float64)
    for p in range(c.task_prompts):
        target[p, torch.randperm(V, generator=g)[:c.target]] = 1.0
    if (settings.ceiling if auto else eta) > c.max_eta:
        raise ValueError(f"arm {arm!r}: eta or ceiling above max_eta={c.max_eta}")
    # one size for every arm, so that claim s gets the same prompt, lengths and uniforms in each
    # the quota's claims, with room for the groups the filter drops (each gives its place back)
    max_claims = 2 * (c.max_eta + c.steps + 2) * P
    prompt_of = torch.randint(0, c.task_prompts, (max_claims,), generator=g).repeat_interleave(n)
    z = torch.randn(max_claims * n, generator=g, dtype=torch.float64)
    length = (c.len_mu + c.len_sigma * z).exp().ceil().clamp(1, c.max_len).long()
    uni = torch.rand(max_claims * n, c.max_len, generator=g, dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Policy(c.task_prompts, V, c.d, c.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr)
    loss_fn, pmf = LOSSES[c.loss], length_pmf(c)
    tokens = torch.zeros(max_claims * n, c.max_len, dtype=torch.long)
    logp = torch.zeros(max_claims * n, c.max_len)
    ver = torch.zeros(max_claims * n, c.max_len, dtype=torch.long)
    pos = torch.zeros(max_claims * n, dtype=torch.long)
    control = Control(threading, P, eta)

    def publish():  # the generator's view of the current weights, and their evaluation
        with torch.no_grad():
            t = model.table()
        return t, t.double().exp().cumsum(-1), expected_reward(t, target, pmf)

    table, cdf, r0 = publish()
    gen_table, gen_cdf, gen_ver = table, cdf, 0
    evals, rows = [(0.0, 0, r0)], []
    active: list[int] = []          # sample ids in the slots
    left = {}                       # claim index -> samples of its group not finished
    done_pending: list[int] = []    # sample ids finished by the running tick, delivered at its end
    buffer: list[int] = []          # finished rows, insertion (= finish) order
    version, step, dropped = 0, 0, 0
    t_gen, t_pub, idle_since = 0.0, None, 0.0   # next tick / next publish (None: idle trainer)
    pending_stats, staleness = None, []
    while step < c.steps:
        if t_pub is not None and (t_gen is None or t_pub <= t_gen):   # publish first on ties
            now, t_pub = t_pub, None
            version += 1
            step += 1
            table, cdf, r = publish()
            evals.append((now, version, r))
            row = pending_stats
            if auto:
                eta = ctl.observe(row["behav_ess"], row["capped_frac"], row["wait_share"])
                row["eta_why"] = ctl.last["eta_why"]
                control.max_staleness = eta
                if arm == "auto+lr":
                    for pg in opt.param_groups:
                        pg["lr"] = c.lr * ctl.lr_scale()
            control.set_version(version, dropped=dropped // n)  # dropped groups give their places back, as in the runtime
            row.update(time=now, eta_next=eta)
            rows.append(row)
            idle_since = now
            if t_gen is None:
                t_gen = now   # a generator blocked on the quota looks again
        else:
            now = t_gen
            for sid in done_pending:
                s = sid // n
                left[s] -= 1
                if left[s] == 0:
                    buffer.extend(range(s * n, s * n + n))
            done_pending = []
            if gen_ver < version:   # interrupt: in-flight samples continue under the new weights
                gen_table, gen_cdf, gen_ver = table, cdf, version
            while len(active) + n <= c.slots:
                s = control.claim()
                if s is None:
                    break
                if s >= max_claims:
                    raise RuntimeError(f"arm {arm!r}, seed {seed}: more than {max_claims} claims (drops gave "
                                       f"back more places than max_claims allows for): raise it")
                left[s] = n
                active.extend(range(s * n, s * n + n))
            if active:
                ids = torch.tensor(active)
                pp, k = prompt_of[ids], pos[ids]
                prev = torch.where(k == 0, V, tokens[ids, (k - 1).clamp(min=0)])
                tok = torch.searchsorted(gen_cdf[pp, prev], uni[ids, k, None]).squeeze(1).clamp(max=V - 1)
                tokens[ids, k], logp[ids, k], ver[ids, k] = tok, gen_table[pp, prev, tok], gen_ver
                pos[ids] = k + 1
                fin = (k + 1 >= length[ids]).tolist()
                done_pending = [a for a, f in zip(active, fin) if f]
                active = [a for a, f in zip(active, fin) if not f]
                t_gen = now + c.tick_a + c.tick_b * len(ids)
            else:
                t_gen = None   # nothing in flight, nothing admitted: wait for a publish
        if t_pub is None and idle_since is not None:   # an idle trainer looks at the buffer
            fresh = [r for r in buffer if version - int(ver[r, 0]) <= filter_eta]
            dropped += len(buffer) - len(fresh)
            buffer = fresh
            if len(buffer) >= B:
                batch, buffer = buffer[:B], buffer[B:]
                stats, n_tok = train_step(c, model, opt, loss_fn, table, batch, prompt_of, tokens, logp, length,
                                          target, n)
                stale = [version - int(ver[r, 0]) for r in batch]
                staleness += stale
                cost = c.train_c0 + c.train_c1 * n_tok
                wait = now - idle_since
                pending_stats = {"step": step, "eta": eta, "start": now, "wait_s": wait, "train_s": cost,
                                 "wait_share": wait / (wait + cost), "tokens": n_tok, "dropped_total": dropped,
                                 "staleness_max": max(stale), "staleness_mean": sum(stale) / B,
                                 "lr": opt.param_groups[0]["lr"], **stats}
                t_pub, idle_since = now + cost, None
            elif t_gen is None and not done_pending:   # the quota is spent and every row dropped
                break
    return {"arm": arm, "seed": seed, "rows": rows, "evals": evals, "final_reward": evals[-1][2],
            "initial_reward": r0, "end_time": evals[-1][0], "steps_done": step, "stalled": step < c.steps,
            "dropped": dropped, "staleness_max": max(staleness, default=0),
            "staleness_mean": sum(staleness) / max(1, len(staleness))}


def train_step(c: SimConfig, model, opt, loss_fn, table, batch, prompt_of, tokens, logp, length, target, n):
    """The AReaL trainer step on `batch` (sample ids): prox pass, behaviour stats, group
    advantages, n_minibatches optimizer steps with the arm's loss. Returns (stats, tokens)."""
    ids = torch.tensor(batch)
    L = length[ids]
    T = int(L.max())
    pp, tok, behav = prompt_of[ids], tokens[ids, :T], logp[ids, :T]
    mask = torch.arange(T)[None] < L[:, None]
    prev = torch.cat([torch.full((len(ids), 1), c.vocab), tok[:, :-1]], 1)
    reward = (target[pp[:, None], tok] * mask).sum(1) / L
    prox = table[pp[:, None], prev, tok] * mask   # no-grad: the published table is the current weights
    stats = behaviour_stats(prox, behav, mask, c.cap)
    adv = group_normalised_advantages(reward, ids // n)
    for part in split_by_tokens(L.tolist(), c.n_minibatches):
        r = torch.tensor(part)
        lp = model.table()[pp[r, None], prev[r], tok[r]]
        loss, _ = loss_fn(lp, prox[r], behav[r], adv[r], mask[r], eps_clip=c.eps_clip, behav_imp_weight_cap=c.cap)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    out = {k: stats[k] for k in ("behav_ess", "capped_frac", "gap_mean")}
    return {**out, "reward": float(reward.mean())}, int(L.sum())
