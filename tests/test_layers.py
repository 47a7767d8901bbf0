"""The import layers of common/, tba/ and areal/, checked on the source (AST, nothing imported). Each
folder is a room; a room imports only itself and the rooms below it:

    task level   common/{task,run_config,replay,evaluate,data}.py, run_*.py
                                                anything but the rank and node layers (the entry picks those)
    entry        common/train.py                picks role, ranks and peers: runtime, ranks, nodes
    nodes        common/runtime/nodes/          several nodes: ranks, the core and below
    ranks        common/runtime/ranks/          N trainer ranks: the core and below
    runtime      common/runtime/*.py            the one-node core, the processes: files, shared, engine,
                                                algorithm, contracts; never ranks/ or nodes/
    files        common/runtime/files/          what a run writes on disk: shared, engine, contracts
    shared       common/runtime/shared/         what the processes share in memory: engine, contracts
    plan         common/plan/                   the preflight and the memory plan: engine, contracts
    rewards      common/rewards/                every task's reward: engine, contracts (never the runtime)
    engine       common/engine/{model,checkpoints,kv,sampler,machine}/   one process runs a model; each
                                                room imports the ones before it in that order, and the contracts
    algorithms   tba/, areal/                   their own package, common/contracts/algorithm.py and the contracts
    algorithm    common/contracts/algorithm.py  contracts only
    contracts    common/contracts/*.py          contracts only
Imports point one way: nodes -> ranks -> core -> files -> shared. No import cycle anywhere; no
function-local import of our own modules; a function-local import of a third-party module carries a
comment saying why (on its line, or above its run of imports). A new module must be placed in a
layer here before it can land.
"""
from __future__ import annotations

import pytest

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("common", "tba", "areal")
TASK_LEVEL = {"common.task", "common.run_config", "common.evaluate", "common.data", "common.replay"}
ENGINE = ("model", "checkpoints", "kv", "sampler", "machine")  # the engine's rooms, lowest first
ENGINE_ROOMS = {f"engine.{r}" for r in ENGINE}
CORE = {"runtime", "files", "shared", *ENGINE_ROOMS, "algorithm", "contract"}
ALLOWED = {  # layer -> layers it may import
    "contract": {"contract"},
    "algorithm": {"contract"},
    **{f"engine.{r}": {f"engine.{x}" for x in ENGINE[:i + 1]} | {"contract"} for i, r in enumerate(ENGINE)},
    "shared": {"shared", *ENGINE_ROOMS, "contract"},
    "files": {"files", "shared", *ENGINE_ROOMS, "contract"},
    "runtime": CORE,
    "ranks": {"ranks", *CORE},
    "nodes": {"nodes", "ranks", *CORE},
    "entry": {"entry", "nodes", "ranks", *CORE},
    "plan": {"plan", *ENGINE_ROOMS, "contract"},
    "rewards": {"rewards", *ENGINE_ROOMS, "contract"},
    "algo": {"algo", "algorithm", "contract"},
    "task": {"task", "entry", "algo", "plan", "rewards", *CORE},
}


@dataclass
class Edge:
    src: str
    dst: str
    line: int
    local: bool      # inside a function or class body, not at module level
    commented: bool  # a comment on the import's line or the line above


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, str]:
    """{module: source} for every .py file of common/, tba/, areal/, the task scripts and the modules
    beside them (every .py file at the top)."""
    files = [p for pkg in OURS for p in (ROOT / pkg).rglob("*.py")] + sorted(ROOT.glob("*.py"))
    return {module_of(p): p.read_text() for p in files}


TOP = {module_of(p) for p in ROOT.glob("*.py")}  # run_*.py and what they split off (common/rewards/tldr.py, ...)


def layer(mod: str) -> str | None:
    if mod in TOP or mod in TASK_LEVEL:
        return "task"
    if mod == "common.contracts.algorithm":
        return "algorithm"
    parts = mod.split(".")
    if parts[:2] == ["common", "contracts"] and len(parts) == 3:
        return "contract"
    if parts[:2] == ["common", "engine"] and len(parts) >= 4 and parts[2] in ENGINE:
        return f"engine.{parts[2]}"
    if mod == "common.train":
        return "entry"
    if parts[:2] in (["common", "plan"], ["common", "rewards"]) and len(parts) == 3:
        return parts[1]
    if parts[:2] == ["common", "runtime"] and len(parts) >= 4 and parts[2] in ("ranks", "nodes", "shared", "files"):
        return {"ranks": "ranks", "nodes": "nodes", "shared": "shared", "files": "files"}[parts[2]]
    if parts[:2] == ["common", "runtime"] and len(parts) == 3:
        return "runtime"
    if parts[0] in ("tba", "areal") and len(parts) == 2:
        return "algo"
    return None


@functools.lru_cache(maxsize=None)
def _parse(text: str) -> ast.Module:  # the planted-edge tests re-check the same files
    return ast.parse(text)


def _commented(lines: list[str], ln: int) -> bool:
    """A comment on line `ln` (1-based), or above the run of import lines it belongs to."""
    i = ln - 1
    while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")) and "#" not in lines[i]:
        i -= 1
    return "#" in lines[i] or (i > 0 and lines[i - 1].strip().startswith("#"))


def edges(mods: dict[str, str]) -> list[Edge]:
    """Every import of one of our modules (and every function-local import) in `mods`."""
    out = []
    for src, text in mods.items():
        lines = text.splitlines()
        tree = _parse(text)
        local_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                         ast.ClassDef)) for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from common import task` imports the module common.task; `from common.contracts.ops import x` common.contracts.ops
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            else:
                continue
            ln = node.lineno
            commented = _commented(lines, ln)
            for t in targets:
                if t.split(".")[0] in OURS or id(node) in local_nodes:
                    out.append(Edge(src, t, ln, id(node) in local_nodes, commented))
    return out


def violations(mods: dict[str, str]) -> list[str]:
    """Every broken rule in `mods` (see the module docstring), one line each."""
    packages = {m for m in mods if (ROOT / m.replace(".", "/") / "__init__.py").exists()}  # a folder's docstring
    bad = [f"{m}: not in any layer (place it in tests/test_layers.py)" for m in mods
           if layer(m) is None and m not in packages]
    for e in edges(mods):
        ours = e.dst.split(".")[0] in OURS
        if e.local and ours:
            bad.append(f"{e.src}:{e.line}: function-local import of {e.dst} (imports stand at the top)")
        elif e.local and not e.commented:
            bad.append(f"{e.src}:{e.line}: function-local import of {e.dst} without a comment saying why")
        if not ours or e.dst in ("common", *OURS, *TOP):
            continue
        a, b = layer(e.src), layer(e.dst)
        if a is not None and b not in ALLOWED[a]:
            bad.append(f"{e.src}:{e.line}: {a} module imports {e.dst} ({b})")
        elif a == b == "algo" and e.src.split(".")[0] != e.dst.split(".")[0]:
            bad.append(f"{e.src}:{e.line}: imports another algorithm's package ({e.dst})")
    return bad + [f"import cycle: {' -> '.join(c)}" for c in cycles(mods)]


def cycles(mods: dict[str, str]) -> list[list[str]]:
    """The cycles a depth-first walk of the import graph closes (one per back edge)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges(mods):
        if e.dst in mods and e.dst != e.src:
            graph[e.src].add(e.dst)
    found, state = [], {}  # state: 1 on the DFS stack, 2 done

    def dfs(m, stack):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                dfs(n, stack)
        stack.pop()
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            dfs(m, [])
    return found


def test_layers_hold():
    assert violations(sources()) == []


def test_every_layer_has_modules():
    """The checker sees the tree (an empty walk would pass everything)."""
    mods = sources()
    assert {layer(m) for m in mods} >= set(ALLOWED)  # every room holds modules
    assert len(edges(mods)) > 50


def _planted(module: str, line: str) -> list[str]:
    mods = sources()
    mods[module] = line + "\n" + mods[module]
    return violations(mods)


# (module, the import planted at its top, what the report must say)
PLANTED = [
    ("common.engine.model.transformer", "from common.runtime.trainer import train", "engine.model module imports common.runtime.trainer"),
    # the engine's rooms: model -> checkpoints -> kv -> sampler -> machine, each importing only those before
    ("common.engine.kv.pages", "from common.engine.sampler.sampler import Sampler",
     "engine.kv module imports common.engine.sampler.sampler"),
    ("common.engine.model.linear", "from common.engine.checkpoints.hf_io import load_model",
     "engine.model module imports common.engine.checkpoints.hf_io"),
    ("common.engine.sampler.sampling", "from common.engine.machine.precision import Precision",
     "engine.sampler module imports common.engine.machine.precision"),
    ("common.rewards.math_answer", "from common.runtime.generator import Control", "rewards module imports common.runtime.generator"),
    ("common.plan.memory_plan", "from common.run_config import RunConfig", "plan module imports common.run_config"),
    ("common.runtime.files.state", "from common.runtime.trainer import run_trainer", "files module imports common.runtime.trainer"),
    ("common.runtime.shared.buffer", "from common.runtime.files.state import rng_state",
     "shared module imports common.runtime.files.state"),
    ("common.runtime.generator", "from tba.algo import TBA", "runtime module imports tba.algo"),
    ("tba.algo", "from common.runtime.shared.buffer import ReplayBuffer", "algo module imports common.runtime.shared.buffer"),
    ("areal.algo", "import common.engine.sampler.sampler", "algo module imports common.engine.sampler.sampler"),
    ("areal.algo", "from tba.loss import tb_loss", "another algorithm"),
    ("common.contracts.ops", "from common.engine.model.transformer import Transformer", "contract module imports common.engine.model.transformer"),
    # nodes -> ranks -> core: the core imports neither, ranks never import nodes, and a task reaches
    # them only through the entry (common/train.py)
    ("common.runtime.trainer", "from common.runtime.ranks.group import TrainerGroup",
     "runtime module imports common.runtime.ranks.group"),
    ("common.runtime.files.checkpoint", "from common.runtime.nodes.link import TrainerLink",
     "files module imports common.runtime.nodes.link"),
    ("common.runtime.ranks.group", "from common.runtime.nodes.keys import RunKeys",
     "ranks module imports common.runtime.nodes.keys"),
    ("common.task", "from common.runtime.nodes.world import is_generator_node",
     "task module imports common.runtime.nodes.world"),
    ("common.replay", "from common.runtime.ranks.fsdp import rank_device", "task module imports common.runtime.ranks.fsdp"),
]


@pytest.mark.parametrize("module,line,report", PLANTED, ids=[f"{m}<-{r.split()[-1]}" for m, _, r in PLANTED])
def test_a_planted_back_edge_is_caught(module, line, report):
    assert any(report in v for v in _planted(module, line))


def test_the_allowed_direction_is_not_reported():
    assert not [v for v in _planted("common.runtime.nodes.link", "from common.runtime.ranks.group import TrainerGroup")
                if "nodes module imports" in v]


def test_the_core_stands_alone():
    """The one-node core (common/runtime/*.py) and what it imports never reach ranks/ or nodes/,
    even through another module."""
    mods = sources()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges(mods):
        if e.dst in mods:
            graph[e.src].add(e.dst)
    core = [m for m in mods if layer(m) == "runtime"]
    seen, todo = set(core), list(core)
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    assert len(core) > 10 and {layer(m) for m in seen} <= CORE, sorted(m for m in seen if layer(m) not in CORE)


def test_planted_cycle_is_caught():
    # model <- hf_io already; model -> hf_io closes the loop the two old shims made
    found = _planted("common.engine.model.transformer", "from common.engine.checkpoints.hf_io import load_model")
    assert any(v.startswith("import cycle:") and "common.engine.checkpoints.hf_io" in v and "common.engine.model.transformer" in v
               for v in found), found


def test_planted_local_imports_are_caught():
    found = _planted("common.engine.sampler.sampler", "def f():\n    from common.contracts.ops import token_logp\n")
    assert any("function-local import of common.contracts.ops" in v for v in found)
    found = _planted("common.data", "def f():\n    import yaml\n")
    assert any("function-local import of yaml without a comment" in v for v in found)
    assert not [v for v in _planted("common.data", "def f():\n    import yaml  # optional\n") if "yaml" in v]


def test_unplaced_module_is_refused():
    mods = {**sources(), "common.newthing": "import torch\n"}
    assert "common.newthing: not in any layer (place it in tests/test_layers.py)" in violations(mods)


def test_benchmarks_and_notebooks_do_not_import_the_tests():
    """bench/ and notebooks/ are part of the product: what they need (e.g. a tiny model,
    common/engine/checkpoints/tiny_model.py) lives in common/, never in tests/."""
    bad = []
    for p in sorted([*(ROOT / "bench").glob("*.py"), *(ROOT / "notebooks").glob("*.py")]):
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{p.relative_to(ROOT)}:{node.lineno}: imports {n}" for n in names if n.split(".")[0] == "tests"]
    assert bad == []
