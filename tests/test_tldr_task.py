"""TL;DR task: data rows, post truncation, reward models loaded by path (decoder and encoder),
the no-EOS penalty, Bradley-Terry training, win-rate tie rule, KL/win-rate evaluation on tiny
models, the bootstrap interval, the shared entry point, and a tiny end-to-end run."""
import json
from types import SimpleNamespace

import pytest
import torch

import run_tldr
from common.rewards import tldr as tldr_reward_model
from common.contracts.errors import UserError
from common.evaluate import bootstrap_diff, win_vector
from common.rewards.reward_model import RewardModel, pair_accuracy, train_bradley_terry
from tests import tiny

WORDS = ["good", "bad", "post", "summary", "the", "a", "cat", "dog", "ran", "home", "is", "was", "my", "i", "."]


def tiny_bert_rm(path, seed=0, num_labels=1):
    """A random 2-layer BERT sequence-classification RM (scalar head) + a word-piece tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast
    path.mkdir(parents=True, exist_ok=True)
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS)})
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, num_labels=num_labels,
                     initializer_range=0.3)  # larger than the default 0.02: scores that differ
    BertForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def tiny_llama_rm(path):
    """A random tiny Llama sequence-classification RM with the test tokenizer (no [SEP]: text mode)."""
    import transformers
    cfg = transformers.LlamaConfig(**{**tiny.BASE, "num_labels": 1})
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(path)
    tiny.tokenizer().save_pretrained(path)
    return str(path)


def test_rows_from_local_sample_and_hub_shapes(tmp_path):
    ex = run_tldr.load_split(str(run_tldr.default_data_dir("tldr")), "val", limit=3)
    assert len(ex) == 3 and len(ex[0].sentences) > 1 and ex[0].summary
    hub = run_tldr.example_from_row({"prompt": "SUBREDDIT: r/cats\nPOST: My cat ran. It came home.\nTL;DR:",
                                     "completion": " cat ran home"}, "row 0")
    assert hub.summary == "cat ran home" and hub.sentences[-1] == "It came home."
    (tmp_path / "train.jsonl").write_text(json.dumps({"document": ["a ."], "summary": "x"}) + "\n{bad\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:2: malformed JSON"):
        run_tldr.load_split(str(tmp_path), "train")
    with pytest.raises(ValueError, match=r"row 7: missing or empty 'summary'"):
        run_tldr.example_from_row({"document": ["a ."]}, "row 7")


def test_post_truncated_on_sentence_boundary():
    tok = tiny.tokenizer()
    sents = ["w3 w4 w5 .", "w6 w7 .", "w8 w9 w10 w11 ."]  # "." is unknown -> one token each
    assert run_tldr.truncate_post(sents, tok, 9) == "w3 w4 w5 . w6 w7 ."  # 4 + 3 tokens fit, + 5 does not
    assert run_tldr.truncate_post(sents, tok, 2) == "w3 w4"              # first sentence cut to fit


@pytest.mark.parametrize("kind", ["bert_pair", "llama_text"])
def test_reward_model_by_path_scores_batches(tmp_path, kind):
    path = tiny_bert_rm(tmp_path / "rm") if kind == "bert_pair" else tiny_llama_rm(tmp_path / "rm")
    rm = RewardModel(path, batch_size=3)
    assert rm.pair == (kind == "bert_pair")
    words = WORDS if kind == "bert_pair" else [f"w{i}" for i in range(3, 20)]
    posts = [" ".join(words[i:i + 5]) for i in range(7)]
    summ = [" ".join(words[i:i + 1 + i % 3]) for i in range(7)]
    batched = rm.score(posts, summ)
    one = [rm.score([p], [s])[0] for p, s in zip(posts, summ)]
    assert len(batched) == 7 and len(set(round(x, 5) for x in batched)) > 1
    assert batched == pytest.approx(one, abs=1e-4)  # padding never changes a score


def test_reward_models_score_in_bf16_when_asked(tmp_path):
    """`--reward.dtype=bf16` (the reward worker's factory and the gold RM take it): half the weights'
    bytes, and scores within bf16's rounding of fp32's (the ordering of clearly different scores kept)."""
    path = tiny_llama_rm(tmp_path / "rm")
    words = [f"w{i}" for i in range(3, 20)]
    posts, summ = [" ".join(words[i:i + 5]) for i in range(6)], [" ".join(words[i:i + 2]) for i in range(6)]
    full, half = RewardModel(path), RewardModel(path, dtype=torch.bfloat16)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    a, b = full.score(posts, summ), half.score(posts, summ)
    assert b == pytest.approx(a, abs=0.05 * max(map(abs, a)) + 1e-3)
    fn = tldr_reward_model.make_rm_reward(path, "auto", 128, 4, "cpu", "bf16")
    assert fn(summ[:2], posts[:2]) == pytest.approx(half.score(tldr_reward_model.rm_prompts(half, posts[:2]), summ[:2]),
                                                    abs=1e-6)


def test_rm_with_a_vector_head_is_refused(tmp_path):
    path = tiny_bert_rm(tmp_path / "rm", num_labels=2)  # a two-class classifier, not a reward model
    with pytest.raises(ValueError, match="num_labels = 2"):
        RewardModel(path)


def test_no_eos_penalty_applies_exactly_to_cut_samples():
    from common.contracts.batch import PromptSet
    from common.runtime.generator import score
    comps = [SimpleNamespace(tokens=[5, 6], finish_reason=f) for f in ("stop", "length", "stop", "length")]
    stats = torch.zeros(8, dtype=torch.float64)
    seen = []
    r = score(comps, 0, PromptSet([[1]], ["post"]), lambda t, m: seen.append(t) or 0.7, None, stats,
              no_stop_reward=-1.0)
    assert r == [0.7, -1.0, 0.7, -1.0] and len(seen) == 2  # cut samples are never sent to the RM
    assert score(comps, 0, PromptSet([[1]]), lambda t, m: 0.7, None, stats) == [0.7] * 4  # None: off


def test_bradley_terry_learns_a_toy_preference(tmp_path):
    rm = RewardModel(tiny_bert_rm(tmp_path / "rm"), batch_size=32)
    g = torch.Generator().manual_seed(0)
    filler = WORDS[2:]

    def pairs(n):
        out = []
        for _ in range(n):
            ctx = " ".join(filler[int(i)] for i in torch.randint(0, len(filler), (6,), generator=g))
            body = " ".join(filler[int(i)] for i in torch.randint(0, len(filler), (3,), generator=g))
            out.append((ctx, f"good {body}", f"bad {body}"))
        return out
    train, held = pairs(192), pairs(64)
    before = pair_accuracy(rm, held)
    stats = train_bradley_terry(rm, train, epochs=3, lr=3e-3, batch_size=16, progress=False)
    after = pair_accuracy(rm, held)
    assert stats["bt_loss_last"] < stats["bt_loss_first"]
    assert after >= 0.95, (before, after)


def test_win_rate_of_copying_the_reference_is_one_half():
    refs = ["a cat ran", "my dog", "home"]
    noisy = [1.0, 2.0000001, -3.0]  # a batched judge may differ in the last bits on the same text
    assert win_vector(noisy, [1.00001, 2.0, -3.0], refs, list(refs)) == [0.5, 0.5, 0.5]
    assert win_vector([2.0, 0.0, 1.0], [1.0, 1.0, 1.00001], ["x", "y", "z"], refs) == [1.0, 0.0, 0.5]


def test_bootstrap_interval():
    same = bootstrap_diff([0, 1, 0.5, 1], [0, 1, 0.5, 1])
    assert same["diff"] == 0 and same["ci_low"] == same["ci_high"] == 0
    up = bootstrap_diff([0.0] * 30 + [1.0] * 10, [1.0] * 30 + [0.0] * 10)
    assert up["diff"] == pytest.approx(0.5) and 0.2 < up["ci_low"] < up["diff"] < up["ci_high"] <= 1.0


def test_preference_pairs_kinds():
    ex = [run_tldr.TLDRExample([f"s{i} one .", "two ."], f"tl dr number {i}") for i in range(5)]
    pairs = tldr_reward_model.preference_pairs(ex, 4, seed=0)
    assert {p[3] for p in pairs} == {"other", "lead", "truncated", "shuffled"}
    assert all(p[1] != p[2] for p in pairs) and all(p[1] == ex[int(p[0][1])].summary for p in pairs)


def test_entry_point_every_algo_and_help(capsys):
    for algo in ("tba", "areal", "grpo"):
        cfg = run_tldr.make_config([f"--algo={algo}"])
        assert cfg.algo == algo and cfg.train.reward_workers == 1
    assert run_tldr.make_config(["--algo=areal"]).train.max_staleness == 4  # AReaL's defaults applied
    assert run_tldr.make_config(["--preset=gpu"]).gen.n == 20
    with pytest.raises(SystemExit):
        run_tldr.make_config(["--help"])
    out = capsys.readouterr().out
    assert "one of 'tba', 'areal', 'grpo'" in out and "--reward.gold_model" in out


def _tiny_policy(path):
    tiny.save_hf("llama_tied", path)
    tiny.tokenizer().save_pretrained(path)
    return str(path)


def test_evaluator_on_tiny_models(tmp_path):
    from common.engine.checkpoints.hf_io import load_model
    policy = _tiny_policy(tmp_path / "policy")
    cfg = run_tldr.make_config([f"--model={policy}", "--data.eval_max_new_tokens=5", "--gen.temperature=1.0"])
    tok = tiny.tokenizer()
    posts = ["w5 w6 w7", "w8 w9", "w10 w11 w12 w13"]
    ev = run_tldr.Evaluator(cfg, [tok(p)["input_ids"] for p in posts], posts, ["w3", "w4 w5", "w6"], (2,),
                            tiny_llama_rm(tmp_path / "gold"))
    out = ev(load_model(policy, tokenizer=False)[0], tok)
    assert out["eval_n"] == 3 and 0 <= out["eval_win_rate"] <= 1 and out["eval_len"] > 0
    assert out["eval_kl"] == pytest.approx(0.0, abs=1e-5)  # policy == reference
    assert out["eval_ref_ppl"] > 1 and len(ev.wins) == 1


def test_tiny_end_to_end_run(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"document": [f"w{3 + i} w{4 + i} .", f"w{5 + i} ."], "summary": f"w{3 + i} w{9 + i}"} for i in range(8)]
    for split in ("train", "val"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = run_tldr.main([f"--model={_tiny_policy(tmp_path / 'policy')}", f"--data.source={data}",
                          f"--reward.model={tiny_llama_rm(tmp_path / 'rm')}",
                          f"--reward.gold_model={tiny_llama_rm(tmp_path / 'gold')}",
                          f"--run_root={tmp_path / 'runs'}", "--train.steps=2", "--train.mode=sync",
                          "--train.prompts_per_step=2", "--gen.n=2", "--gen.max_new_tokens=4", "--data.eval_size=4",
                          "--data.eval_max_new_tokens=4", "--precision.dtype=fp32", "--train.checkpoint_every=0"])
    assert last["version"] == 2 and "eval_win_rate" in last
    summary = json.loads((tmp_path / "runs" / "tldr_tba" / "eval_summary.json").read_text())
    assert summary["win_rate"]["n"] == 4 and summary["win_rate"]["ci_low"] <= summary["win_rate"]["diff"]


def test_a_reward_model_that_is_neither_a_folder_nor_a_hub_id_names_its_flag(tmp_path):
    def never():
        raise AssertionError("the offline RMs are not trained for a named model")
    with pytest.raises(UserError, match=r"^--reward\.gold_model=tiny: neither a local directory nor a hub id"):
        tldr_reward_model.resolve_rm("tiny", "gold", never)
    with pytest.raises(UserError, match=r"^--reward\.model=\./nowhere: neither"):
        tldr_reward_model.resolve_rm("./nowhere", "policy", never)
    assert tldr_reward_model.resolve_rm(str(tmp_path), "policy", never) == str(tmp_path)  # a folder, as given
    assert tldr_reward_model.resolve_rm("owner/rm", "policy", never) == "owner/rm"        # a hub id, for transformers
