"""The layered import contract of ARCHITECTURE.md, checked by parsing every module's imports."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "quant"
# a module may import only modules of its own layer or lower layers
LAYERS = [
    {"cli", "console"},
    {"run.pipeline"},
    {"run.stages"},
    {"report", "export", "publish", "study"},
    {"engine.quantize", "eval.evaluate", "plan.runtimes", "plan.summary", "forecast.estimate", "forecast.footprint",
     "plan.servable"},
    {"plan.bitplan", "plan.layer_policy"},
    {"measure.profile", "engine.hessians", "engine.awq_layer", "eval.stream", "eval.layer_error", "engine.rank_split",
     "measure.layer_damage"},
    {"engine.layerwise", "calibration", "engine.qstore", "eval.lmeval", "eval.humaneval"},
    {"dist.relay"},
    {"eval.sandbox", "engine.routing", "models", "io.rundir", "dist.world", "progress"},
    {"algos"},
    {"recipe", "forecast.throughputs"},
    {"strict_yaml", "io.storage", "diag.memtrace", "diag.hostsync", "diag.calltime", "io.staging", "io.direct_read",
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


# on-disk / transformers names (what checkpoints and runtimes see) and model classes: models/ alone spells them
DISK_NAMES = ("gate_proj", "up_proj", "down_proj", "block_sparse_moe", "self_attn", "model.layers", "w1.weight",
              "Qwen3Moe", "MixtralSparse")


def _code_strings(tree: ast.Module):
    """String literals of a module's code (f-string parts included), docstrings left out: a docstring may show an
    on-disk name as an example, code may not build or test one."""
    docs = {id(body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and (body := n.body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n


def test_model_knowledge_stays_in_models():
    """Outside models/ no code names an on-disk module or tests which family a model is (canonical names only,
    family facts as FamilySpec attributes)."""
    from quant.models.families import FAMILIES

    families = set(FAMILIES) | {t for f in FAMILIES.values() for t in f.model_types}
    found = []
    for path in PKG.rglob("*.py"):
        if "models" in path.relative_to(PKG).parts:
            continue
        for s in _code_strings(ast.parse(path.read_text())):
            found += [f"{path.relative_to(PKG)}:{s.lineno}: {needle!r}" for needle in DISK_NAMES if needle in s.value]
            if s.value in families:
                found.append(f"{path.relative_to(PKG)}:{s.lineno}: family {s.value!r}")
    assert not found, found


def test_benchmarks_use_the_public_api_and_tests_never_import_them():
    """Benchmark scripts import quant's public names (no ``_private`` ones), never another benchmark script and
    never edit ``sys.path`` (they run from the repository root with quant importable); tests may run a benchmark
    as a subprocess but never import one."""
    root = PKG.parent
    scripts = {p.stem for p in (root / "benchmarks").glob("*.py")} | {"benchmarks"}
    bad = []
    for path in sorted((root / "benchmarks").rglob("*.py")) + sorted((root / "tests").rglob("*.py")):
        rel, is_test = path.relative_to(root), path.parts[len(root.parts)] == "tests"
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module:
                names = [n.module]
                if n.module.startswith("quant") and not is_test:
                    bad += [f"{rel}: private {n.module}.{a.name}" for a in n.names if a.name.startswith("_")]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            else:
                if (isinstance(n, ast.Attribute) and n.attr in ("insert", "append") and isinstance(n.value, ast.Attribute)
                        and n.value.attr == "path" and getattr(n.value.value, "id", None) == "sys" and not is_test):
                    bad.append(f"{rel}:{n.lineno}: sys.path.{n.attr}")
                continue
            bad += [f"{rel}:{n.lineno}: imports {m}" for m in names if m.split(".")[0] in scripts]
    assert not bad, bad
