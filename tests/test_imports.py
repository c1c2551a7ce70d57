"""The layered import contract of ARCHITECTURE.md, checked by parsing every module's imports."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "quant"
# a module may import only modules of its own layer or lower layers
LAYERS = [
    {"cli", "console"},
    {"run.pipeline"},
    {"run.stages"},
    {"report", "export", "publish"},
    {"engine.quantize", "eval.evaluate", "plan.runtimes", "plan.summary", "forecast.estimate", "forecast.footprint",
     "plan.servable"},
    {"plan.bitplan", "plan.layer_policy"},
    {"measure.profile", "engine.hessians", "engine.awq_layer", "eval.stream", "eval.shipped_gptq", "engine.rank_split",
     "measure.layer_damage"},
    {"engine.layerwise", "calibration", "engine.qstore", "eval.lmeval", "eval.humaneval"},
    {"dist.relay"},
    {"eval.sandbox", "engine.routing", "models", "io.rundir", "dist.world", "progress"},
    {"algos"},
    {"recipe", "forecast.throughputs"},
    {"strict_yaml", "io.storage", "diag.memtrace", "diag.hostsync", "io.staging", "io.direct_read",
     "eval.sandbox_child"},
    {"eval.isolation", "eval.seccomp"},
    {"errors", "serve"},
]


def _unit(module: str) -> str:
    """The contract's name for a module: the longest entry of LAYERS that it is, or that it lies inside."""
    rel = module.removeprefix("quant.")
    names = [n for layer in LAYERS for n in layer if rel == n or rel.startswith(n + ".")]
    if not names:
        raise AssertionError(f"{module} is not placed in the import contract")
    return max(names, key=len)


def _layer(module: str) -> int:
    unit = _unit(module)
    return next(i for i, names in enumerate(LAYERS) if unit in names)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("quant"):
            # ``from quant.pkg import mod`` imports the module quant.pkg.mod
            subs = {f"{node.module}.{a.name}" for a in node.names
                    if (PKG.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()}
            out |= subs or {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("quant")}
    return {m for m in out if m != "quant"}


def test_imports_only_point_down():
    violations = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        me = ".".join(rel.parts).removesuffix(".__init__")
        if me == "quant" or (path.name == "__init__.py" and not _imports(path)):
            continue
        mine = _layer(me)
        for target in _imports(path):
            if _unit(target) == _unit(me):
                continue
            if _layer(target) < mine:
                violations.append(f"{me} -> {target}")
    assert not violations, violations


def test_no_print_in_package_outside_cli():
    for path in PKG.rglob("*.py"):
        if path.name == "cli.py":
            continue
        calls = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
        assert not calls, f"print() in {path}"


def test_model_knowledge_stays_in_models():
    """No family-specific strings outside models/ (canonical names only)."""
    for path in PKG.rglob("*.py"):
        if "models" in path.parts or path.name in ("runtimes.py",) or "export" in path.parts:
            continue
        text = path.read_text()
        for needle in ("gate_proj", "block_sparse_moe", "Qwen3Moe", "MixtralSparse", "w1.weight"):
            assert needle not in text, f"{needle} in {path}"
