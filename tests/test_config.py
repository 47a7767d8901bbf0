"""Tests for common/contracts/config.py: typed overrides, error messages, --help, JSON round trip."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

import run_gsm8k
from common.contracts.config import (ConfigError, cli, flatten, load_config, parse_overrides,
                           save_config, to_dict)


@dataclass
class TBAConfig:
    beta_init: float = 0.012   # initial inverse-temperature of the target
    beta_final: float = 0.004  # final beta after linear anneal
    m: float = 0.95            # fraction of batch slots from the latest sync round
    sampling: Literal["uniform", "reward"] = "uniform"  # how non-recent slots pick responses
    use_kl: bool = False       # add a KL penalty


@dataclass
class OptimConfig:
    lr: float = 1e-6  # learning rate
    warmup: int = 10


@dataclass
class RunConfig:
    name: str = "gsm8k#1"          # run directory name under runs/
    seed: int = 0                  # global seed
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"  # HF id or local dir
    max_steps: Optional[int] = None  # stop after this many trainer steps
    temperature: float | None = 1.0  # sampling temperature
    stop_ids: tuple[int, ...] = ()   # extra stop token ids
    tags: list[str] = field(default_factory=list)  # free-form run tags
    tba: TBAConfig = field(default_factory=TBAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


def test_overrides_of_each_type():
    c = parse_overrides(RunConfig(), [
        "--seed=3", "--name", "x", "--tba.beta_final=1e-5", "--tba.m=1",
        "--tba.sampling=reward", "--tba.use_kl", "--max_steps=100", "--temperature=none",
        "--stop_ids=1,2,3", "--tags=a,b", "--optim.lr", "-2e-5", "--optim.warmup", "7",
    ])
    assert (c.seed, c.name, c.max_steps, c.temperature) == (3, "x", 100, None)
    assert c.tba == TBAConfig(beta_final=1e-5, m=1.0, sampling="reward", use_kl=True)
    assert isinstance(c.tba.m, float)
    assert c.stop_ids == (1, 2, 3) and c.tags == ["a", "b"]
    assert c.optim == OptimConfig(lr=-2e-5, warmup=7)
    assert parse_overrides(c, ["--max_steps=null"]).max_steps is None
    assert parse_overrides(c, ["--stop_ids="]).stop_ids == ()


@pytest.mark.parametrize("argv,expected", [
    (["--tba.use_kl=true"], True), (["--tba.use_kl=0"], False), (["--tba.use_kl=yes"], True),
    (["--tba.use_kl", "no"], False), (["--tba.use_kl", "--seed=1"], True), (["--tba.use_kl"], True),
])
def test_bool_forms(argv, expected):
    assert parse_overrides(RunConfig(), argv).tba.use_kl is expected


def test_original_unchanged():
    c = RunConfig()
    new = parse_overrides(c, ["--tba.m=0.5", "--seed=9"])
    assert c == RunConfig() and new.tba.m == 0.5 and new.tba is not c.tba


def test_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError) as e:
        parse_overrides(RunConfig(), ["--tba.beta_fnal=0.1"])
    msg = str(e.value)
    assert "tba.beta_fnal" in msg and "tba.beta_final" in msg and "beta_init" in msg
    with pytest.raises(ConfigError, match="did you mean '--seed'"):
        parse_overrides(RunConfig(), ["--sed=1"])
    with pytest.raises(ConfigError, match="unknown key '--nope.x'"):
        parse_overrides(RunConfig(), ["--nope.x=1"])


@pytest.mark.parametrize("arg,suggested", [
    ("--beta_final=0.1", "'--tba.beta_final'"),       # a section's key given at top level
    ("--tba.seed=1", "'--seed'"),                      # a top-level key given in a section
    ("--tab.m=0.5", "'--tba.m'"),                      # the section's name mistyped
    ("--beta_fnal=0.1", "'--tba.beta_final'"),         # mistyped, and given outside its section
])
def test_did_you_mean_looks_into_sections(arg, suggested):
    with pytest.raises(ConfigError, match=f"unknown key '{re.escape(arg.split('=')[0])}'; did you mean {suggested}\\?"):
        parse_overrides(RunConfig(), [arg])


def test_did_you_mean_in_a_task_script():
    """`--mode=sync` is `--train.mode`, `--steps=5` and `--gen.steps=5` are `--train.steps`."""
    for arg, key in (("--mode=sync", "train.mode"), ("--steps=5", "train.steps"), ("--gen.steps=5", "train.steps")):
        with pytest.raises(ConfigError, match=f"did you mean '--{key}'\\?"):
            parse_overrides(run_gsm8k.GSM8KConfig(), [arg])


def test_bad_values():
    with pytest.raises(ConfigError) as e:
        parse_overrides(RunConfig(), ["--tba.m=abc"])
    assert "tba.m" in str(e.value) and "float" in str(e.value) and "'abc'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_overrides(RunConfig(), ["--tba.sampling=greedy"])
    assert "'uniform'" in str(e.value) and "'reward'" in str(e.value)
    for argv in (["--seed=1.5"], ["--seed=none"], ["--stop_ids=1,x"], ["--tba.use_kl=maybe"]):
        with pytest.raises(ConfigError):
            parse_overrides(RunConfig(), argv)


def test_structural_errors():
    with pytest.raises(ConfigError, match="section"):
        parse_overrides(RunConfig(), ["--tba=1"])
    with pytest.raises(ConfigError, match="not a section"):
        parse_overrides(RunConfig(), ["--seed.x=1"])
    with pytest.raises(ConfigError, match="positional"):
        parse_overrides(RunConfig(), ["seed=1"])
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(RunConfig(), ["--seed"])


def test_flatten():
    flat = flatten(RunConfig())
    assert flat["tba.beta_final"] == 0.004 and flat["seed"] == 0 and "tba" not in flat
    assert len(flat) == 14


def test_save_load_round_trip(tmp_path):
    c = parse_overrides(RunConfig(), ["--stop_ids=5,6", "--tags=a", "--max_steps=4"])
    assert load_config(RunConfig, to_dict(c)) == c
    path = tmp_path / "deep" / "dir" / "config.json"
    save_config(c, path)
    assert json.loads(path.read_text())["tba"]["beta_final"] == 0.004
    assert [p.name for p in path.parent.iterdir()] == ["config.json"]  # no temp left behind
    back = load_config(RunConfig, path)
    assert back == c and back.stop_ids == (5, 6)
    assert load_config(RunConfig, {"seed": 2}) == RunConfig(seed=2)  # missing keys -> defaults


def test_load_unknown_key(tmp_path):
    d = to_dict(RunConfig())
    d["tba"]["bogus"] = 1
    d["extra"] = 2
    with pytest.raises(ConfigError, match="extra"):
        load_config(RunConfig, d)
    del d["extra"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="tba.bogus"):
        load_config(RunConfig, path)


def test_cli(capsys):
    assert cli(RunConfig(), ["--seed=5"]).seed == 5
    with pytest.raises(SystemExit) as e:
        cli(RunConfig(), ["--tba.m=abc"])
    assert e.value.code == 2 and "tba.m" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli(RunConfig(), ["--seed=1", "--help"], description="GSM8K run")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "GSM8K run" in out and "--tba.beta_final" in out and "0.004" in out
    assert "final beta after linear anneal" in out and "how non-recent slots pick" in out
    assert "run directory name under runs/" in out  # '#' inside the default is not a comment
    assert "--optim.warmup" in out
