"""The one loss contract (common/contracts/algorithm.py: call_loss) on a tiny model: TBA, GRPO and AReaL
pass every scalar stat a loss returns through and require none; a loss asks for settings and
micro-batch fields by keyword; bad losses are errors naming them; `make_algo` / `task.run` take
a loss function or an Algorithm; overwrite replaces a run."""
import pytest
import torch

from areal.algo import AReaL, AReaLConfig
from areal.loss import decoupled_ppo_loss
from common.contracts.algorithm import call_loss, scalar_stats
from common.contracts.batch import PromptSet
from common.contracts.run_files import record
from common.engine.checkpoints.hf_io import load_model
from common.engine.machine.precision import PrecisionConfig
from common.runtime.files.run_dir import open_run_dir
from common.runtime.generator import GenConfig
from common.runtime.train_config import TrainConfig
from common.task import RunConfig, make_algo
from common.train import train
from tba.algo import GRPO, TBA, GRPOConfig, TBAConfig
from tba.loss import tb_loss
from tests.test_tba_algo import _batch
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    save_hf("llama_tied", d)
    return load_model(str(d), tokenizer=False)[0]


def length_normalised_tb(seq_logp, ref_seq_logp, reward, group_id, beta, *, comp_lens):
    """TB on per-token log-ratios, a micro-batch field by keyword, no functools.partial."""
    kl = (seq_logp - ref_seq_logp) / comp_lens.clamp(min=1)
    resid = kl - reward / beta
    return (resid - resid.detach().mean()).pow(2).mean(), {"kl_per_token": kl.mean(), "ones": 1}


def plain_pg(logp, prox_logp, behav_logp, advantages, mask):
    """A loss that returns only a tensor and takes none of AReaL's settings."""
    return -(advantages[:, None] * logp * mask).sum() / mask.sum()


def test_tba_binds_a_batch_field_by_keyword_and_logs_every_stat(model):
    b = _batch()
    seen = []

    def spy(seq_logp, ref_seq_logp, reward, group_id, beta, comp_lens, tokens=None):
        seen.append((comp_lens.tolist(), tokens.shape[0]))
        return length_normalised_tb(seq_logp, ref_seq_logp, reward, group_id, beta, comp_lens=comp_lens)

    for loss in (length_normalised_tb, spy):
        stats = TBA(TBAConfig(beta_init=0.5), 4, 3, 0.7, 40, loss_fn=loss).backward(model, b, step=0)
        assert stats["ones"] == pytest.approx(1.0)  # micro-batch shares of a stat add up to the batch's
        assert {"loss", "kl_per_token", "beta"} <= stats.keys() and "log_z" not in stats
    assert len(seen) > 1 and sum(len(c) for c, _ in seen) == len(b)  # every micro-batch's own rows
    assert all(len(c) == n for c, n in seen)


def test_areal_requires_no_stat_and_passes_every_one_through(model):
    b = _batch()
    algo = AReaL(AReaLConfig(n_minibatches=1), 4, 3, 0.7, 40, max_staleness=2, loss_fn=plain_pg)
    mb, = algo.minibatches(model, b, step=0)
    stats = algo.backward(model, mb, step=0)
    assert "clip_frac" not in stats and {"loss", "behav_ess", "adv_abs"} <= stats.keys()

    def with_stats(logp, prox_logp, behav_logp, advantages, mask, eps_clip, prox_minus_behav=None):
        loss, st = decoupled_ppo_loss(logp, prox_logp, behav_logp, advantages, mask, eps_clip=eps_clip)
        return loss, {**st, "eps_seen": eps_clip, "tokens": float(mask.sum())}

    algo = AReaL(AReaLConfig(n_minibatches=1, eps_clip=0.3), 4, 3, 0.7, 40, max_staleness=2, loss_fn=with_stats)
    stats = algo.backward(model, mb, step=0)
    assert stats["eps_seen"] == pytest.approx(0.3) and "clip_frac" in stats
    assert stats["tokens"] > 0  # token-weighted over micro-batches, like the loss


def test_areal_loss_may_ask_for_extra_fields(model):
    def asks(lp, prox, behav, adv, mask, *, advantages, versions):  # Batch.extra's and Batch's
        return plain_pg(lp, prox, behav, adv, mask), {"same": float((advantages == adv).all()), "v": versions.max()}

    algo = AReaL(AReaLConfig(n_minibatches=1), 4, 3, 0.7, 40, max_staleness=2, loss_fn=asks)
    mb, = algo.minibatches(model, _batch(), step=0)
    stats = algo.backward(model, mb, step=0)
    assert stats["same"] == pytest.approx(1.0) and stats["v"] == 0.0


def test_grpo_takes_a_loss_function(model):
    def clipped(token_logp, behav_logp, loss_mask, advantages, eps_clip):
        return -(advantages[:, None] * token_logp * loss_mask).sum() / loss_mask.sum(), {"eps": eps_clip}
    stats = GRPO(GRPOConfig(eps_clip=0.1), 4, 3, 0.7, 40, loss_fn=clipped).backward(model, _batch(), step=0)
    assert stats["eps"] == pytest.approx(0.1) and "kl_seq" in stats


def test_bad_losses_are_errors_naming_them(model):
    def two_args(seq_logp, reward):
        return seq_logp.sum()
    with pytest.raises(ValueError, match="loss .*two_args takes 2 positional arguments, the algorithm passes 5"):
        TBA(TBAConfig(), 4, 3, 0.7, 40, loss_fn=two_args)
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        TBA(TBAConfig(), 4, 3, 0.7, 40, loss_fn="tb_loss")

    def wants_unknown(seq_logp, ref_seq_logp, reward, group_id, beta, *, lengths):
        return seq_logp.sum()
    b = _batch()
    algo = TBA(TBAConfig(beta_init=0.5), 4, 3, 0.7, 10_000, loss_fn=wants_unknown)  # extra keys unknown until a batch
    with pytest.raises(ValueError, match="wants_unknown asks for 'lengths'.*comp_lens"):
        algo.backward(model, b, step=0)

    def vector_stat(seq_logp, ref_seq_logp, reward, group_id, beta):
        return seq_logp.mean(), {"per_row": seq_logp.detach()}
    with pytest.raises(ValueError, match="stat 'per_row' must be a scalar"):
        TBA(TBAConfig(beta_init=0.5), 4, 3, 0.7, 10_000, loss_fn=vector_stat).backward(model, b, step=0)
    with pytest.raises(ValueError, match="must return a scalar tensor"):
        call_loss(lambda x: x, b, torch.ones(3))
    assert scalar_stats({"a": torch.tensor(2.0), "b": 3}) == {"a": 2.0, "b": 3.0}


def _cfg(tmp_path, algo="tba") -> RunConfig:
    return RunConfig(name="r", algo=algo, model=str(tmp_path / "m"), run_root=str(tmp_path / "runs"),
                     gen=GenConfig(n=3), train=TrainConfig(prompts_per_step=4, max_staleness=2),
                     precision=PrecisionConfig(dtype="fp32"))


def test_make_algo_takes_a_loss_function_or_an_algorithm(tmp_path):
    for name, cls, default in (("tba", TBA, tb_loss), ("areal", AReaL, decoupled_ppo_loss), ("grpo", GRPO, None)):
        algo = make_algo(_cfg(tmp_path, name))
        assert type(algo) is cls and (default is None or algo.loss_fn is default)
        custom = make_algo(_cfg(tmp_path, name), loss=lambda *a, **k: a[0].sum())
        assert type(custom) is cls and custom.loss_fn is not algo.loss_fn
    mine = TBA(TBAConfig(), 4, 3, 1.0, 64)
    assert make_algo(_cfg(tmp_path), loss=mine) is mine
    with pytest.raises(TypeError, match="loss must be a loss function or an Algorithm"):
        make_algo(_cfg(tmp_path), loss="tb_loss_no_ref")


def test_a_run_directory_is_kept_unless_overwrite(tmp_path):
    cfg = _cfg(tmp_path)
    d = open_run_dir(cfg, resume=False)  # an earlier run's folder, as a run leaves it
    record(d / "metrics.jsonl")
    (d / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(FileExistsError, match=r"--resume, resume=True\), replace it \(--overwrite, overwrite=True"):
        train(cfg, make_algo(cfg), PromptSet([[5, 6]]), lambda t, m: 0.0, ())
    assert (tmp_path / "runs" / "r" / "metrics.jsonl").exists()
