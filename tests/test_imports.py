"""The layered import contract of docs/architecture.md, checked by parsing every module's imports.

Packages (and the top-level modules beside them) sit in the rows of the architecture's table: a module imports only
packages of its own row or of rows below it. Inside a package whose modules have an order, the same holds module by
module (``MODULES``), so following one layer's quantize through ``quantize/`` never climbs back up.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "quant"
# docs/architecture.md's table, top to bottom: top-level modules and subpackages
PACKAGES = [
    {"cli", "console"},
    {"run"},
    {"report", "publish"},
    {"card"},
    {"export", "forecast"},
    {"eval"},
    {"plan"},
    {"profile"},
    {"quantize"},
    {"layerwise"},
    {"calibration"},
    {"models"},
    {"parallel"},
    {"io", "diag"},
    {"algos"},
    {"recipe", "strict_yaml", "progress"},
    {"errors", "serve", "scheme"},
]
# run in the sandbox's child processes, where quant is not importable: they import each other only
STANDALONE = {"eval.sandbox_child", "eval.isolation", "eval.seccomp"}
# module order inside a package, top to bottom (packages not listed are one unit)
MODULES = {
    "run": [{"pipeline"}, {"stages"}],
    "forecast": [{"estimate"}, {"layer_costs", "footprint"}, {"algorithm_costs"}, {"throughputs"}],
    "eval": [{"evaluate"}, {"stream", "layer_error", "shipped_gptq"}, {"lmeval", "humaneval"}, {"sandbox"}, {"sandbox_child"},
             {"isolation", "seccomp"}],
    "plan": [{"runtimes", "summary", "servable"}, {"bitplan"}, {"policies"}, {"joint_policy"},
             {"layer_policy", "expert_policy"}],
    "profile": [{"profile", "layer_damage"}, {"damage_memory"}],
    "quantize": [{"driver"}, {"algorithms"}, {"gptq_layer", "awq_layer"}, {"layer_job"}, {"rank_split", "hessians"},
                 {"results", "solvers", "budgets", "qstore"}, {"routing"}],
    "parallel": [{"relay"}, {"world"}],
    "io": [{"rundir"}, {"storage", "staging", "direct_read"}],
    "diag": [{"memtrace", "hostsync", "calltime"}],
}


def _place(module: str) -> tuple[int, str, int]:
    """(package row, package, module level inside the package: 0 for the package itself or an unordered one)."""
    parts = module.removeprefix("quant.").split(".")
    package = parts[0]
    row = next((i for i, names in enumerate(PACKAGES) if package in names), None)
    if row is None:
        raise AssertionError(f"{module}: package '{package}' is not placed in the import contract")
    if package not in MODULES or len(parts) == 1:
        return row, package, 0
    level = next((i for i, names in enumerate(MODULES[package]) if parts[1] in names), None)
    if level is None:
        raise AssertionError(f"{module} is not placed in {package}'s module order")
    return row, package, level


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


def _violations() -> list[str]:
    violations = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        me = ".".join(rel.parts).removesuffix(".__init__")
        if me == "quant" or (path.name == "__init__.py" and not _imports(path)):
            continue
        row, package, level = _place(me)
        for target in _imports(path):
            t_row, t_package, t_level = _place(target)
            if t_row < row or (t_package == package and t_level < level):
                violations.append(f"{me} -> {target}")
    return violations


def test_imports_only_point_down():
    violations = _violations()
    assert not violations, violations


def test_the_sandbox_child_modules_import_each_other_only():
    for module in STANDALONE:
        path = PKG / (module.replace(".", "/") + ".py")
        outside = {t.removeprefix("quant.") for t in _imports(path)} - STANDALONE
        assert not outside, (module, outside)


def test_every_package_and_ordered_module_is_placed():
    """A new subpackage, or a new module of a package with an order, must be placed (it fails loudly otherwise)."""
    for path in PKG.rglob("*.py"):
        rel = ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        if rel != "quant":
            _place(rel)


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


# the one module of benchmarks/ that is not a benchmark: the records' reader, which tests import to read the records
RECORDS_READER = "benchmarks.records"


def test_benchmarks_use_the_public_api_and_tests_never_import_them():
    """Benchmark scripts import quant's public names (no ``_private`` ones), never another benchmark script and
    never edit ``sys.path`` (they run from the repository root with quant importable); tests may run a benchmark
    as a subprocess but never import one. Tests may import the records' reader (``benchmarks/records.py``), which
    imports the standard library only."""
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
            bad += [f"{rel}:{n.lineno}: imports {m}" for m in names
                    if m.split(".")[0] in scripts and not (is_test and m == RECORDS_READER)]
    assert not bad, bad


def test_the_records_reader_imports_the_standard_library_only():
    """Tests import ``benchmarks/records.py``: it stays a reader of JSON files, importing neither quant nor torch."""
    import sys

    path = PKG.parent / "benchmarks" / "records.py"
    imported = {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m.split(".")[0] for m in imported} <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_the_package_names_no_file_of_the_repository_outside_it():
    """The wheel ships quant/ alone: no code of the package names a path under benchmarks/ or studies/ (the records a
    forecast rate comes from are named in comments; the rate itself is a constant)."""
    found = [f"{path.relative_to(PKG)}:{s.lineno}: {s.value!r}" for path in PKG.rglob("*.py")
             for s in _code_strings(ast.parse(path.read_text())) if "benchmarks/" in s.value or "studies/" in s.value]
    assert not found, found


def test_the_installed_package_holds_neither_studies_nor_weights():
    """What ``pip install`` ships (pyproject's packages and package data): no study code, no file over 1 MB, a few
    MB in all; the studies and the reference MoE's weights stay with the repository."""
    import fnmatch

    import tomllib

    cfg = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = cfg["package-data"]["quant"]
    shipped = [p for p in PKG.rglob("*") if p.is_file() and "__pycache__" not in p.parts
               and (p.suffix == ".py" or any(fnmatch.fnmatch(str(p.relative_to(PKG)), g) for g in data))]
    assert cfg["packages"]["find"]["include"] == ["quant*"] and not (PKG / "study").exists()
    assert max(p.stat().st_size for p in shipped) < 1e6 and sum(p.stat().st_size for p in shipped) < 5e6
