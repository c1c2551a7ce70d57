"""Plug-ins are asked, not named: no module of the package compares a plan policy's or an algorithm's name as a
string (``policy == "joint"``, ``algorithm in ("gptq", "awq")``) outside the module that defines that plug-in; what
differs between them is asked of the registered objects (``plan.policies.POLICIES``, ``quantize.algorithms
.ALGORITHMS``, ``forecast.algorithm_costs.COSTS``). The recipe's rules for each policy are registered under the same
names as the policies."""

import ast
import inspect
from pathlib import Path

from quant.plan.policies import POLICIES
from quant.quantize.algorithms import ALGORITHMS
from quant.recipe import POLICY_RULES

PKG = Path(__file__).resolve().parents[1] / "quant"
KINDS = ("policy", "algorithm")  # what a variable or attribute holding a plug-in's name is called


def _owners() -> dict[str, set[Path]]:
    """Registered name -> the modules that define it (a policy's deciding function, an algorithm's class)."""
    out: dict[str, set[Path]] = {}
    for name, p in POLICIES.items():
        out.setdefault(name, set()).add(Path(inspect.getfile(p.experts or p.layers)).resolve())
    for name, a in ALGORITHMS.items():
        out.setdefault(name, set()).add(Path(inspect.getfile(type(a))).resolve())
    return out


def _names_a_plugin(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return any(kind in name for kind in KINDS)


def _strings(node: ast.AST) -> set[str]:
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_no_module_compares_a_policy_or_algorithm_name_outside_its_own():
    owners = _owners()
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            named = set().union(*map(_strings, operands)) & set(owners)
            if any(map(_names_a_plugin, operands)) and any(path.resolve() not in owners[n] for n in named):
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: {sorted(named)}")
    assert not found, found


def test_the_recipe_s_policy_rules_are_the_registered_policies():
    assert list(POLICY_RULES) == list(POLICIES)
