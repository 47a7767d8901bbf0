"""The faults table's attack rows (bench/faults.py, bench/faults_store.py, bench/faults_attacks.py) run end to end: each ends
in the promised one-line message within seconds, nothing of the attack achieved (no payload ran, no
foreign file deleted, nothing written outside run_root), no process or /dev/shm entry left. The
behaviours themselves are pinned closer to the code: tests/test_wire.py (a forged store value, also in
a live two-node run), tests/test_checkpoint_trust.py (a planted checkpoint or buffer), tests/test_run_names.py
and tests/test_user_errors.py (run names, --overwrite, a truncated model), tests/test_write_errors.py
(a real full disk), tests/test_config_ranges.py (every setting)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "faults.py"


def _rows(tmp_path, *names) -> dict:
    out = subprocess.run([sys.executable, str(BENCH), "--only", *names, "--root", str(tmp_path / "f")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["scenario"]: r for r in map(json.loads, out.stdout.splitlines()) if "scenario" in r}
    for name, r in rows.items():
        assert "error" not in r, r
        assert r["detected"] and r["processes_left"] == 0 and r["shm_left"] == [], r
        assert r["detect_s"] < 60, r
    return rows


@pytest.mark.slow  # the suite's time: each row's refusal has its own test (test_run_names.py, test_config_ranges.py, test_wire.py)
def test_hostile_run_name_zero_size_setting_overwrite_secret_and_address_rows(tmp_path):
    rows = _rows(tmp_path, "hostile_run_name", "zero_size_setting", "foreign_overwrite", "weak_secret",
                 "wildcard_master_addr", "truncated_model")
    name = rows["hostile_run_name"]
    assert name["exit_code"] == [2, 2] and name["message"].startswith("error: run name '../../x'")
    assert name["foreign_file_kept"] and not name["outside_written"]
    assert "was not made by this project" in name["overwrite_message"] and "nothing was changed" in name["overwrite_message"]
    zero = rows["zero_size_setting"]
    assert zero["exit_code"] == [2] and zero["message"].startswith("error: --gen.max_batch=0") and not zero["run_dir_made"]
    over = rows["foreign_overwrite"]
    assert over["exit_code"] == [2] and over["foreign_file_kept"] and over["nothing_removed"]
    assert "checkpoints/step_000001/model/notes.txt" in over["message"] and "nothing was removed" in over["message"]
    for name in ("weak_secret", "wildcard_master_addr"):  # refused on every node before a folder or a socket
        assert rows[name]["exit_code"] == [1, 1] and not rows[name]["run_dir_made"], rows[name]
    assert rows["truncated_model"]["exit_code"] == [2] and not rows["truncated_model"]["checkpoints_made"]


@pytest.mark.slow  # two minutes and a half: each behaviour is in the default suite (module docstring)
def test_planted_files_store_values_and_full_disk_rows(tmp_path):
    rows = _rows(tmp_path, "planted_checkpoint", "planted_buffer", "absurd_buffer", "forged_store_value",
                 "replayed_store_value", "earlier_run_value", "disk_full")
    assert not rows["planted_buffer"]["payload_ran"] and rows["planted_buffer"]["exit_code"] == [2]
    assert rows["absurd_buffer"]["exit_code"] == [2]
    assert not rows["replayed_store_value"]["keyerror"] and rows["replayed_store_value"]["checkpoint_after"]
    assert not rows["planted_checkpoint"]["payload_ran"] and rows["planted_checkpoint"]["exit_code"] != [0]
    assert not rows["forged_store_value"]["payload_ran"] and rows["forged_store_value"]["checkpoint_after"]
    assert rows["disk_full"]["tmp_dirs_left"] == 0 and rows["disk_full"]["latest_checkpoint"] is not None


def test_every_sandbox_attack_during_a_run(tmp_path):
    """Every attack of the sandbox's table as the problems of a tiny run: reward 0, nothing reached or
    left, and the run goes on to its last step (each attack on its own: tests/test_sandbox.py)."""
    rows = _rows(tmp_path, "attacks_during_a_run")  # each attack's own row: tests/test_sandbox.py in-process
    run = rows["attacks_during_a_run"]
    assert run["steps"] == 4 and run["exit_code"] == [0] and run["reward_mean_max"] == 0.0, run
    assert run["reward_refused"] > 0 and run["reward_timeouts"] > 0, run
    for r in rows.values():
        assert not r["outside_written"] and not r["connected"] and r["tmp_dirs_left"] == 0, r
