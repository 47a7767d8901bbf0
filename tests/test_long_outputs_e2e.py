"""A long-output AReaL run on the tiny model (CPU): answers of 1,500 tokens each through a paged KV
pool too small for the batch, so samples are preempted and resumed while weight updates interrupt
them; the run checkpoints, resumes, and trains on every answer whole."""
from common.contracts.log import read_metrics
from common.train import train
from tests.test_areal_e2e import _algo, _areal_cfg
from tests.test_e2e import _prompts, toy_reward

NEW = 1500


def test_long_answers_with_preemption_interruption_and_resume(tmp_path):
    cfg = _areal_cfg(tmp_path, eta=1, steps=2, checkpoint_every=2, prompts_per_step=2, min_buffer=4,
                     micro_batch_tokens=4096)
    cfg.gen.n, cfg.gen.max_batch, cfg.gen.max_new_tokens = 2, 4, NEW
    # 4 rows of up to ~1,500 live tokens want 6,000; the pool holds 3,072: the youngest are preempted
    cfg.gen.kv_tokens, cfg.gen.kv_page_size = 3072, 64
    train(cfg, _algo(cfg), _prompts(), toy_reward, stop_token_ids=())
    cfg.train.steps = 4
    train(cfg, _algo(cfg), _prompts(), toy_reward, stop_token_ids=(), resume=True)
    rows = [r for r in read_metrics(f"{cfg.run_root}/{cfg.name}/metrics.jsonl") if "staleness_hist" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["comp_len_max"] == NEW and r["comp_len_mean"] == NEW for r in rows)  # no stop id: every answer whole
    for part in (rows[:2], rows[2:]):  # before and after the resume (a fresh generator: its counters restart)
        assert part[-1]["gen_preemptions"] > 0 and part[-1]["gen_interrupts"] > 0, part[-1]
        assert 0 < part[-1]["kv_occupancy"] <= 1
