"""The seams, checked from the source: imports point one way.

- no import cycle between modules (imports at module level; lazy imports inside functions
  are how an upper layer is reached without loading it, and are checked per package below);
- between packages, counting lazy imports too, no cycle, and these never import upward:
    config   nothing of ptrain but itself (and no JAX)
    sandbox  nothing of ptrain but config (and no JAX); envs and the CLI use it
    data     no envs, rollout or stages
    rollout  no envs, stages or serve (the collector that joins engines and environments is
             the RL stage's; the HTTP server is a user of the engines)
    stages   no serve, api, cli, client or tinker (their users), but for the edges in EXCEPTIONS
    serve    no tinker (the Tinker server is a user of the client and of the serve helpers)
    envs     no stages
- composing and validating a config loads neither JAX nor a stage or environment module;
  nor does importing the sandbox (environment worker processes and its CLI import it).
"""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = {
    "ptrain.config": {"*"},
    "ptrain.data": {"ptrain.envs", "ptrain.rollout", "ptrain.stages"},
    "ptrain.rollout": {"ptrain.envs", "ptrain.stages", "ptrain.serve"},
    "ptrain.stages": {"ptrain.serve", "ptrain.api", "ptrain.cli", "ptrain.client", "ptrain.tinker"},
    "ptrain.serve": {"ptrain.tinker"},
    "ptrain.envs": {"ptrain.stages"},
    "ptrain.losses": {"ptrain.stages", "ptrain.train", "ptrain.models"},
    "ptrain.models": {"ptrain.stages", "ptrain.train", "ptrain.rollout", "ptrain.envs"},
}
ALLOWED_ONLY = {
    "ptrain.sandbox": {"ptrain.config"},
}
# Module edges across those rules, each with its reason.
EXCEPTIONS = {
    # The eval stage serves its own engine in process for lm-evaluation-harness (lazily, only
    # with algo.eval.lm_eval.tasks): a server process would hold a second copy of the weights.
    ("ptrain.stages.eval", "ptrain.serve.lm_harness"),
}


def modules() -> dict[str, str]:
    out = {}
    for top, name in (("ptrain", "ptrain"), ("kernels", "ptrain.kernels")):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    rel = os.path.relpath(path, os.path.join(ROOT, top))[:-3].replace(os.sep, ".")
                    mod = name if rel == "__init__" else f"{name}.{rel.removesuffix('.__init__')}"
                    out[mod] = path
    return out


MODULES = modules()


def imported(mod: str, node: ast.AST) -> set[str]:
    """The ptrain modules one import statement loads (a `from pkg import submodule` counts
    the submodule, not the package's __init__ contents)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in MODULES}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        base = mod.split(".")
        if not MODULES[mod].endswith("__init__.py"):
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    subs = {f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in MODULES}
    out = set(subs)
    if len(subs) < len(node.names) and name in MODULES:
        out.add(name)
    return out


def graph(module_level_only: bool) -> dict[str, set[str]]:
    edges = {}
    for mod, path in MODULES.items():
        tree = ast.parse(open(path).read(), path)
        nodes = tree.body if module_level_only else ast.walk(tree)
        deps = set()
        for node in nodes:
            deps |= imported(mod, node)
        edges[mod] = deps - {mod}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def package(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) > 2 and parts[1] == "kernels":
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def test_no_import_cycle_between_modules():
    assert cycles(graph(module_level_only=True)) == []


def test_packages_import_one_way():
    edges = graph(module_level_only=False)
    by_package: dict[str, set[str]] = {}
    upward = []
    for mod, deps in edges.items():
        for dep in deps:
            a, b = package(mod), package(dep)
            if a == b or b == "ptrain" or (mod, dep) in EXCEPTIONS:
                continue
            by_package.setdefault(a, set()).add(b)
            banned = FORBIDDEN.get(a, set())
            if "*" in banned or b in banned or (a in ALLOWED_ONLY and b not in ALLOWED_ONLY[a]):
                upward.append(f"{mod} imports {dep}")
    assert upward == []
    assert cycles(by_package) == []


def test_composing_a_config_loads_no_jax_and_no_stage_or_environment():
    code = (
        "import sys, ptrain\n"
        "cfg = ptrain.compose('sft_grpo_arithmetic', ['train.steps=8'])\n"
        "assert cfg.stages[1].kind == 'grpo'\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'grain', 'optax')\n"
        "             or m.startswith(('ptrain.stages', 'ptrain.envs', 'ptrain.rollout', 'ptrain.models')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_the_sandbox_loads_no_jax_and_no_environment():
    code = (
        "import sys, ptrain.sandbox, ptrain.sandbox.__main__\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'grain', 'optax')\n"
        "             or m.startswith(('ptrain.stages', 'ptrain.envs', 'ptrain.rollout', 'ptrain.models')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
