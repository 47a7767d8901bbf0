"""A task script's `main(argv, reward=None, loss=None)` driven from code read on standard input
(`python - <<EOF`, whose `__main__` has no file, as in a notebook): a reward defined there
reaches the generators (or the reward workers) by value and the run finishes; a function of no
arguments is taken as a reward-worker factory (`task.split_reward`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from common.task import split_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STDIN_SCRIPT = textwrap.dedent('''
    import json, sys
    import run_gsm8k
    from tests.tiny import save_hf, tokenizer

    model = sys.argv[1] + "/model"
    save_hf("llama_tied", model)
    tokenizer().save_pretrained(model)

    def quarter(text, gold):           # fn(text, meta): meta is GSM8K's gold answer
        assert isinstance(gold, str)
        return 0.25

    def make_half():                   # no arguments: a factory, built once per reward worker
        return lambda texts, golds: [0.5] * len(texts)

    common = [f"--model={model}", f"--run_root={sys.argv[1]}/runs", "--overwrite", "--precision.dtype=fp32",
              "--train.steps=2", "--train.prompts_per_step=2", "--gen.n=2", "--train.min_buffer=4",
              "--gen.max_new_tokens=4", "--data.train_limit=8", "--data.eval_size=0", "--train.checkpoint_every=0"]
    out = {}
    # a per-sample function in a reward worker is tests/test_by_value.py's (a notebook's, by value); from
    # standard input here: the function in the generator, the factory in a reward worker
    for name, reward, extra in (("fn", quarter, []), ("factory", make_half, ["--train.reward_workers=1"])):
        last = run_gsm8k.main([f"--name={name}", *common, *extra], reward=reward)
        out[name] = last["reward_mean"]
    print("RESULT " + json.dumps(out))
''')


def test_a_task_driven_from_stdin_with_its_own_reward_finishes(tmp_path):
    p = subprocess.run([sys.executable, "-", str(tmp_path)], input=STDIN_SCRIPT, cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "ASYNCRL_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out == {"fn": 0.25, "factory": 0.5}


def test_split_reward_tells_a_factory_from_a_per_sample_reward():
    def fn(text, meta):
        return 1.0

    def factory():
        return lambda texts, metas: [1.0] * len(texts)

    def factory_with_defaults(scale=2.0):
        return lambda texts, metas: [scale] * len(texts)

    assert split_reward(fn) == (fn, None)
    assert split_reward(factory) == (None, factory)
    assert split_reward(factory_with_defaults) == (None, factory_with_defaults)
    lam = lambda text, meta: 0.0  # noqa: E731 - a notebook's one-liner
    assert split_reward(lam) == (lam, None)
    with pytest.raises(TypeError, match="reward must be"):
        split_reward(0.5)


@pytest.fixture
def tiny_dir(tmp_path):
    from tests.tiny import save_hf, tokenizer
    save_hf("llama_tied", tmp_path / "m")
    tokenizer().save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _argv(tmp_path, model, *extra):
    return [f"--model={model}", f"--run_root={tmp_path / 'runs'}", "--precision.dtype=fp32", "--train.steps=2",
            "--train.prompts_per_step=2", "--gen.n=2", "--train.min_buffer=4", "--gen.max_new_tokens=4",
            "--train.checkpoint_every=0", *extra]


def _const_reward(text, meta):
    return 0.75


def test_tldr_and_redteam_take_a_reward_without_their_reward_models(tmp_path, tiny_dir):
    """TL;DR without its reward models (none is trained or loaded: evaluation is off) and
    red-teaming without its victim: the given reward scores every sample, in the task's reward
    worker (TL;DR's reward of a sample cut without EOS is set to the same value, so that the mean
    is exact whichever samples stop)."""
    import run_redteam
    import run_tldr
    last = run_tldr.main(_argv(tmp_path, tiny_dir, "--name=tldr", "--data.train_limit=8", "--data.eval_size=0",
                               "--gen.no_stop_reward=0.75"), reward=_const_reward)
    assert last["reward_mean"] == 0.75
    last = run_redteam.main(_argv(tmp_path, tiny_dir, "--name=redteam", "--data.eval_attacks=0"),
                            reward=_const_reward)
    assert last["reward_mean"] == 0.75


TASK_SCRIPT = '''
from __future__ import annotations
import dataclasses, pickle, subprocess, sys
from common import task
from common.runtime.generator import GenConfig
from common.runtime.pickling import dumps

@dataclasses.dataclass
class MyConfig:  # a task's config class, its annotations strings (from __future__ import annotations)
    gen: GenConfig = dataclasses.field(default_factory=GenConfig)

def main():
    # what a worker does with a config class it was sent: resolve its annotations (load_config)
    child = "import pickle, sys, typing; print(typing.get_type_hints(pickle.loads(sys.stdin.buffer.read()))['gen'])"
    out = subprocess.run([sys.executable, "-c", child], input=dumps(MyConfig), capture_output=True, cwd=sys.argv[1],
                         env={"PYTHONPATH": sys.argv[2]})
    print("MODULE", main.__module__, "CHILD", out.stdout.decode().strip() or out.stderr.decode().strip()[-300:])

if __name__ == "__main__":
    task.script(main)
'''


def test_a_task_script_run_as_main_sends_its_classes_by_reference(tmp_path):
    """`python run_x.py` runs `main` from the script imported under its own name, so a config class
    of the script reaches a worker by reference and resolves its annotations there (sent by value
    from `__main__`, `typing.get_type_hints` fails in the worker with NameError)."""
    (tmp_path / "my_task.py").write_text(TASK_SCRIPT)
    p = subprocess.run([sys.executable, str(tmp_path / "my_task.py"), str(tmp_path), f"{tmp_path}:{ROOT}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})  # this tree's common/, whatever is installed
    assert p.returncode == 0, p.stderr[-2000:]
    assert "MODULE my_task CHILD <class 'common.runtime.generator.GenConfig'>" in p.stdout, p.stdout + p.stderr[-2000:]
