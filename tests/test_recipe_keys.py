"""Every recipe key does something: each field of the schema is read by the package outside the schema's own
classes (their validators only check it), so a key that nothing reads cannot be accepted silently.

The check reads the package's source (``ast``) and follows a recipe section from where it is typed: a parameter
annotated with a section class (``spec: QuantizeSpec``), ``recipe`` (a ``Recipe``), an attribute chain from one
(``recipe.profile.layer_sensitivity``), a section's ``model_validate*`` result, names and ``self.`` attributes
assigned from those, values of a dict section in a ``for`` over ``.items()``/``.values()``; a call of one of the
schema's own methods that is not a validator (``spec.pinned_layers()``) reads the fields that method reads. A field read only through a path it cannot follow would be
reported falsely; then the fix is an annotation at the read, not an entry in a list of exceptions.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args, get_origin

from pydantic import BaseModel

import quant.recipe as recipe_module
from tests.conftest import REPO

SECTIONS = {name: c for name, c in vars(recipe_module).items()
            if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == recipe_module.__name__
            and c.model_fields}


def _held(annotation) -> tuple[type | None, bool]:
    """(section class a field holds, whether as a dict's values)."""
    if get_origin(annotation) is dict:
        value = get_args(annotation)[1]
        return (value, True) if value in SECTIONS.values() else (None, False)
    for a in (annotation, *get_args(annotation)):
        if a in SECTIONS.values():
            return a, False
    return None, False


class _Reads(ast.NodeVisitor):
    """Collects (section class name, field) pairs read as attributes."""

    def __init__(self, class_attrs: dict[str, dict[str, object]], accessors: dict[tuple[str, str], set[str]]):
        self.scopes: list[dict[str, object]] = [{}]
        self.classes: list[str] = []
        self.class_attrs = class_attrs  # class name -> self attribute -> type, over the whole package
        self.accessors = accessors  # (section, method) -> fields the method reads
        self.reads: set[tuple[str, str]] = set()

    def _annotation(self, node) -> object:
        if node is None:
            return None
        text = ast.unparse(node).replace(" | None", "").strip("'\"")
        if text in SECTIONS:
            return SECTIONS[text]
        return ("class", text) if text in self.class_attrs else None

    def typeof(self, node) -> object:
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return None
        if isinstance(node, ast.Attribute):
            owner = self.typeof(node.value)
            if isinstance(owner, tuple) and owner[0] == "class":
                return self.class_attrs.get(owner[1], {}).get(node.attr)
            if node.attr == "recipe":
                return recipe_module.Recipe
            if owner in SECTIONS.values() and node.attr in owner.model_fields:
                held, as_dict = _held(owner.model_fields[node.attr].annotation)
                return ("dict", held) if as_dict else held
            return None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith(
                "model_validate") and isinstance(node.func.value, ast.Name) and node.func.value.id in SECTIONS):
            return SECTIONS[node.func.value.id]  # Recipe.model_validate_json(...)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("items", "values"):
            owner = self.typeof(node.func.value)
            if isinstance(owner, tuple) and owner[0] == "dict":
                return (node.func.attr, owner[1])
        return None

    def _bind(self, target, value_type) -> None:
        if value_type is None:
            return
        if isinstance(target, ast.Name):
            self.scopes[-1][target.id] = value_type
        elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
              and self.classes):
            self.class_attrs.setdefault(self.classes[-1], {})[target.attr] = value_type

    def visit_ClassDef(self, node) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node) -> None:
        scope: dict[str, object] = {}
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        for a in args:
            t = self._annotation(a.annotation) or (recipe_module.Recipe if a.arg == "recipe" else None)
            if a.arg == "self" and self.classes:
                t = ("class", self.classes[-1])
            if t is not None:
                scope[a.arg] = t
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node) -> None:
        self.generic_visit(node)
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for t, v in zip(target.elts, node.value.elts, strict=False):
                    self._bind(t, self.typeof(v))
            else:
                self._bind(target, self.typeof(node.value))

    def visit_AnnAssign(self, node) -> None:
        self.generic_visit(node)
        self._bind(node.target, self._annotation(node.annotation) or (self.typeof(node.value) if node.value else None))

    def visit_For(self, node) -> None:
        it = self.typeof(node.iter)
        if isinstance(it, tuple) and it[0] == "items" and isinstance(node.target, ast.Tuple):
            self._bind(node.target.elts[1], it[1])
        elif isinstance(it, tuple) and it[0] == "values":
            self._bind(node.target, it[1])
        self.generic_visit(node)

    def visit_Attribute(self, node) -> None:
        owner = self.typeof(node.value)
        if owner in SECTIONS.values() and node.attr in owner.model_fields:
            self.reads.add((owner.__name__, node.attr))
        if owner in SECTIONS.values():  # a method of the section (spec.pinned_layers()) reads what it reads
            self.reads |= {(owner.__name__, f) for f in self.accessors.get((owner.__name__, node.attr), ())}
        self.generic_visit(node)


def _accessors(tree: ast.Module) -> dict[tuple[str, str], set[str]]:
    """(section, method) -> the fields the method reads from ``self``, for the schema's methods that are not
    validators (those only check a value; a method the package calls hands fields out)."""
    out = {}
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and cls.name in SECTIONS):
            continue
        for fn in cls.body:
            validator = isinstance(fn, ast.FunctionDef) and any(
                "validator" in ast.unparse(d) for d in fn.decorator_list)
            if isinstance(fn, ast.FunctionDef) and not validator:
                out[(cls.name, fn.name)] = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                                            and isinstance(n.value, ast.Name) and n.value.id == "self"
                                            and n.attr in SECTIONS[cls.name].model_fields}
    return out


def _package_trees() -> tuple[list[ast.Module], dict[tuple[str, str], set[str]]]:
    """Every module of the package (the schema's classes left out: they read their own fields to check them), and
    the schema's accessor methods."""
    trees, accessors = [], {}
    for path in sorted((REPO / "quant").rglob("*.py")):
        tree = ast.parse(path.read_text())
        if path == Path(recipe_module.__file__).resolve():
            accessors = _accessors(tree)
            tree.body = [n for n in tree.body if not (isinstance(n, ast.ClassDef) and n.name in SECTIONS)]
        trees.append(tree)
    return trees, accessors


def fields_read(trees: list[ast.Module], accessors: dict | None = None) -> set[tuple[str, str]]:
    class_attrs: dict[str, dict[str, object]] = {}
    for _ in range(2):  # the second pass knows every class's self attributes
        reads = set()
        for tree in trees:
            visitor = _Reads(class_attrs, accessors or {})
            visitor.visit(tree)
            reads |= visitor.reads
    return reads


def test_every_recipe_field_is_read_by_the_package():
    read = fields_read(*_package_trees())
    unread = [f"{cls}.{name}" for cls, c in SECTIONS.items() for name in c.model_fields if (cls, name) not in read]
    assert not unread, f"recipe keys nothing in quant/ reads (remove them, or use them): {unread}"


def test_the_walk_follows_sections_and_sees_nothing_else():
    code = """
class Job:
    def __init__(self, spec: QuantizeSpec, other):
        self.spec, self.other = spec, other
    def run(self):
        return self.spec.awq_grid + self.other.batch_size
def gates(recipe: Recipe):
    e = recipe.eval
    for name, g in e.gates.items():
        print(g.max_drop)
    return recipe.profile.layer_sensitivity.n_samples
def untyped(spec):
    return spec.dampening
"""
    assert fields_read([ast.parse(code)]) == {
        ("QuantizeSpec", "awq_grid"), ("Recipe", "eval"), ("EvalSpec", "gates"), ("GateSpec", "max_drop"),
        ("Recipe", "profile"), ("ProfileSpec", "layer_sensitivity"), ("LayerSensitivitySpec", "n_samples")}
    accessor = "def pinned(spec: PlanSpec):\n    return spec.pinned_layers()\n"
    assert fields_read([ast.parse(accessor)], {("PlanSpec", "pinned_layers"): {"layer_schemes"}}) == {
        ("PlanSpec", "layer_schemes")}
