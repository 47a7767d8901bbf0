"""One rule for what one sample needs of the paged KV pool (common/engine/kv/pages.py:
sample_kv_tokens), shared by the sampler's refusal, the run's check before its workers start
(common/runtime/generator.py: check_kv_pool), the config's range check (RunConfig's gen.kv_tokens)
and the memory plan: walked over prompt and answer lengths against the sampler itself, which runs a
sample to its full length in exactly that pool and refuses it one page less."""
import pytest

import run_gsm8k
from common.contracts.config import ConfigError
from common.engine.checkpoints.hf_io import load_model
from common.engine.kv.pages import sample_kv_tokens
from common.plan.memory_plan import PROMPT_TOKENS
from common.engine.sampler.sampler import Sampler
from common.engine.sampler.sampling import SamplingParams
from common.contracts.errors import UserError
from common.plan.preflight import plan_of
from common.runtime.generator import GenConfig, check_kv_pool
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    save_hf("llama3_untied", d)
    return load_model(str(d), tokenizer=False)[0]


@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("prompt", [1, 15, 16, 17, 33])
@pytest.mark.parametrize("new", [1, 15, 16, 31])
def test_the_sampler_runs_a_sample_in_exactly_what_the_rule_says_and_refuses_one_page_less(llama, page, prompt, new):
    need = sample_kv_tokens(prompt, new, page)
    assert need % page == 0 and need == (-(-prompt // page) + -(-(new + 1) // page)) * page
    ids = [5 + i % 50 for i in range(prompt)]
    s = Sampler(llama, max_batch=2, max_seq_len=prompt + new, page_size=page, kv_tokens=need)
    out = s.generate([ids], SamplingParams(max_new_tokens=new, temperature=1.0, n=1, seed=3))
    assert len(out[0].tokens) == new and out[0].finish_reason == "length"  # no stop ids: the full length
    assert s.stats["preemptions"] == 0
    small = Sampler(llama, max_batch=2, max_seq_len=prompt + new, page_size=page, kv_tokens=need - 1)  # a page less
    with pytest.raises(ValueError, match=f"needs {need:,} tokens of KV pool"):
        small.submit(ids, SamplingParams(max_new_tokens=new, n=1))
    # the run's check before its workers start: the same numbers
    check_kv_pool(GenConfig(kv_tokens=need, max_new_tokens=new, kv_page_size=page), "cpu", prompt)
    with pytest.raises(UserError, match=f"use --gen.kv_tokens={need} or more"):
        check_kv_pool(GenConfig(kv_tokens=need - 1, max_new_tokens=new, kv_page_size=page), "cpu", prompt)


@pytest.mark.parametrize("new, page", [(256, 0), (256, 64), (100, 16), (1000, 256)])
def test_the_range_check_and_the_plan_agree_with_the_rule(new, page):
    """The range check: one sample of a one-token prompt, pages by device (CPU 64); the plan: of a
    PROMPT_TOKENS prompt, counted once. Each accepts the rule's figure and refuses one token less."""
    p = page or 64
    floor, planned = sample_kv_tokens(1, new, p), sample_kv_tokens(PROMPT_TOKENS, new, p)
    args = ["--model=tiny", f"--gen.max_new_tokens={new}", f"--gen.kv_page_size={page}"]
    run_gsm8k.make_config(args + [f"--gen.kv_tokens={floor}"])
    with pytest.raises(ConfigError, match=f"--gen.kv_tokens={floor - 1}: must be 0 .* or at least {floor}"):
        run_gsm8k.make_config(args + [f"--gen.kv_tokens={floor - 1}"])
    assert plan_of(run_gsm8k.make_config(args + [f"--gen.kv_tokens={planned}"])).fits
    short = plan_of(run_gsm8k.make_config(args + [f"--gen.kv_tokens={planned - 1}"]))
    assert not short.fits and short.fixes == [(f"--gen.kv_tokens={planned}", "one full-length sample")]
    if page == 0:  # the issue's own figure: tiny, 256 new tokens, pages of 64: 512 + 320, not 1,344
        assert planned == 832


def test_page_sizes_are_powers_of_two_from_16():
    for bad in (3, 8, 48, 8192):
        with pytest.raises(ConfigError, match=f"--gen.kv_page_size={bad}: must be 0 .* or a power of two from 16 to 4096"):
            run_gsm8k.make_config(["--model=tiny", f"--gen.kv_page_size={bad}"])
    for good in (0, 16, 128, 4096):
        run_gsm8k.make_config(["--model=tiny", f"--gen.kv_page_size={good}"])


def test_a_pool_below_the_longest_prompt_stops_a_run_before_its_workers_start(tmp_path, capsys):
    """With the memory check off, the check of the real prompts still comes before any worker: one
    line, no traceback, no checkpoint."""
    with pytest.raises(UserError, match=r"--gen.kv_tokens=448: a pool of 448 tokens .* holds no sample of the "
                                        r"longest prompt \(\d+ tokens\)"):
        run_gsm8k.main(["--model=tiny", f"--run_root={tmp_path}", "--name=kv", "--memory_check=false",
                        "--gen.kv_tokens=448", "--gen.max_new_tokens=256", "--train.steps=1", "--data.eval_size=0"])
    assert not (tmp_path / "kv" / "checkpoints").exists() and not (tmp_path / "kv" / "workers.json").exists()
