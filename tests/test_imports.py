"""The layered import contract of ARCHITECTURE.md, checked by parsing every module's imports."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "quant"
# a module may import only modules of its own layer or lower layers
LAYERS = [
    {"cli", "console"},
    {"pipeline"},
    {"stages"},
    {"report", "export", "publish"},
    {"quantize", "evaluate", "runtimes", "plan_summary", "estimate", "footprint", "servable"},
    {"plan", "layer_plan"},
    {"profile", "hessians", "smooth", "evalstream", "sharing", "layer_damage"},
    {"layerwise", "calibration", "qstore", "lmeval", "humaneval"},
    {"relay"},
    {"sandbox", "routing", "models", "rundir", "dist", "progress"},
    {"algos"},
    {"recipe", "throughputs"},
    {"strict_yaml", "storage", "memtrace", "hostsync", "staging"},
    {"errors"},
]


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else module
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"quant.{top} is not placed in the import contract")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("quant"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("quant")}
    return {m for m in out if m != "quant"}


def test_imports_only_point_down():
    violations = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        me = ".".join(rel.parts).removesuffix(".__init__")
        if me == "quant":
            continue
        mine = _layer(me)
        for target in _imports(path):
            if target.split(".")[1] == me.split(".")[1]:
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
