"""pyproject.toml (`pip install -e .`) lists every package, task script and module beside them, and
its dependencies are requirements.txt's (what CI installs), cloudpickle among them."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_covers_every_package_and_task_script():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    st = cfg["tool"]["setuptools"]
    assert sorted(st["py-modules"]) == sorted(p.stem for p in ROOT.glob("*.py"))
    include = st["packages"]["find"]["include"]
    for init in ROOT.glob("*/__init__.py"):
        if init.parent.name != "tests":
            assert init.parent.name in include and f"{init.parent.name}.*" in include, init.parent.name
    assert st["dynamic"]["dependencies"]["file"] == ["requirements.txt"]
    reqs = [line.split("==")[0] for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert "cloudpickle" in reqs and "torch" in reqs
