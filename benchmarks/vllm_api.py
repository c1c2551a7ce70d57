"""The vLLM API quant's serving modules depend on, read with ``ast`` from their source and from a vLLM release's.

    python benchmarks/vllm_api.py uses                       # what quant/serve uses of vLLM, as JSON
    python benchmarks/vllm_api.py build SRC VERSION -o FILE  # each used symbol looked up in SRC/vllm (an unpacked
                                                             # wheel's .py files): the manifest FILE
    python benchmarks/vllm_api.py check FILE [FILE ...]      # exit 1 with one line a problem: a use missing from a
                                                             # manifest, or incompatible with its signatures there

A use is an import (module or name), an attribute read off an imported name (``scalar_types.uint4b8``), a call
(positional count, keyword names), a subclass (the base's abstract methods all defined; each override accepting the
base method's parameters; ``self.m(...)`` and ``super().m(...)`` calls to the base's methods) or an attribute read
off a ``layer`` argument (vLLM's fused MoE layer, ``LAYER_CLASS``). Feature checks of the form
``NAME = "arg" in inspect.signature(F).parameters`` are evaluated against each manifest, and a use under ``if NAME:``
(or in ``{...} if NAME else {}`` spread as keywords) is checked only where the branch is taken. Nothing here imports
vLLM or quant: the manifests (``tests/serve/data/vllm-api-*.json``) are what ``tests/serve/test_vllm_api.py`` reads.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = ("quant/serve/vllm_mixed.py", "quant/serve/vllm_plugin.py", "quant/serve/vllm_check.py")
LAYER_CLASS = "vllm.model_executor.layers.fused_moe.RoutedExperts"
# what a ``layer`` argument answers as a torch module, not as vLLM's class
MODULE_ATTRS = {"named_parameters", "register_parameter"}


# ---- the plugin's uses ----------------------------------------------------------------------------------------

def _aliases(tree: ast.Module) -> dict[str, str]:
    """Every local name bound to a vLLM module or symbol by an import anywhere in the file -> its dotted path."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "vllm":
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm" and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _gates(tree: ast.Module, aliases: dict[str, str]) -> dict[str, dict]:
    """Module-level feature checks: ``NAME = "arg" in inspect.signature(F).parameters`` -> {symbol, arg}."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            v = node.value
            if (isinstance(v, ast.Compare) and isinstance(v.ops[0], ast.In) and isinstance(v.left, ast.Constant)
                    and isinstance(v.comparators[0], ast.Attribute) and v.comparators[0].attr == "parameters"
                    and isinstance(v.comparators[0].value, ast.Call) and v.comparators[0].value.args):
                symbol = _dotted(v.comparators[0].value.args[0], aliases)
                if symbol:
                    out[node.targets[0].id] = {"symbol": symbol, "arg": v.left.value}
    return out


def _spread(node: ast.expr, gates: dict, consts: dict) -> tuple[list, bool]:
    """A ``**`` argument as [(keyword, condition or None)], and whether it was understood."""
    if isinstance(node, ast.Name) and node.id in consts:
        node = consts[node.id]
    cond, branches = None, [(node, None)]
    if isinstance(node, ast.IfExp) and isinstance(node.test, ast.Name) and node.test.id in gates:
        cond = node.test.id
        branches = [(node.body, [cond, True]), (node.orelse, [cond, False])]
    out = []
    for b, when in branches:
        if isinstance(b, ast.Dict) and all(isinstance(k, ast.Constant) for k in b.keys):
            out += [(k.value, when) for k in b.keys]
        elif isinstance(b, ast.Call) and isinstance(b.func, ast.Name) and b.func.id == "dict" and not b.args:
            out += [(k.arg, when) for k in b.keywords if k.arg]
        else:
            return [], False
    return out, True


def _call_use(call: ast.Call, target: str, gates: dict, consts: dict, where: str, when: list, bound: bool) -> dict:
    keywords, opaque = [], any(isinstance(a, ast.Starred) for a in call.args)
    for k in call.keywords:
        if k.arg is not None:
            keywords.append([k.arg, None])
            continue
        spread, known = _spread(k.value, gates, consts)
        keywords += [list(s) for s in spread]
        opaque |= not known
    n_pos = sum(not isinstance(a, ast.Starred) for a in call.args)
    return {"kind": "call", "symbol": target, "positional": n_pos, "keywords": keywords, "opaque": opaque,
            "bound": bound, "at": where, "when": when}


class _Walker(ast.NodeVisitor):
    """Collects the uses of one module, tracking the gate conditions of the branches it is inside."""

    def __init__(self, path: str, tree: ast.Module):
        self.path, self.aliases = path, _aliases(tree)
        self.gates = _gates(tree, self.aliases)
        self.consts = {n.targets[0].id: n.value for n in tree.body
                       if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
        self.uses: list[dict] = []
        self.when: list = []
        self.cls: tuple[str, str] | None = None  # (plugin class, its vLLM base) while inside one
        self.own_methods: set[str] = set()

    def at(self, node: ast.AST) -> str:
        return f"{self.path}:{node.lineno}"

    def add(self, use: dict) -> None:
        self.uses.append({**use, "when": list(self.when)})

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if isinstance(test, ast.Name) and test.id in self.gates:
            for body, value in ((node.body, True), (node.orelse, False)):
                self.when.append([test.id, value])
                for s in body:
                    self.visit(s)
                self.when.pop()
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] == "vllm":
                self.add({"kind": "module", "symbol": a.name, "at": self.at(node)})

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if (node.module or "").split(".")[0] == "vllm" and not node.level:
            for a in node.names:
                self.add({"kind": "name", "symbol": f"{node.module}.{a.name}", "at": self.at(node)})

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [b for b in (_dotted(x, self.aliases) for x in node.bases) if b]
        if not bases:
            return self.generic_visit(node)
        outer, self.cls = self.cls, (node.name, bases[0])
        defs = {d.name: d for d in node.body if isinstance(d, ast.FunctionDef)}
        self.own_methods = set(defs)
        self.add({"kind": "subclass", "symbol": bases[0], "class": node.name, "defines": sorted(defs),
                  "at": self.at(node)})
        for name, d in defs.items():
            self.add({"kind": "override", "symbol": f"{bases[0]}.{name}", "params": _params(d.args),
                      "decorators": _decorators(d), "at": self.at(d)})
        self.generic_visit(node)
        self.cls = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        names = {a.arg for a in node.args.args + node.args.kwonlyargs}
        if "layer" in names:
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "layer"
                        and isinstance(sub.ctx, ast.Load) and sub.attr not in MODULE_ATTRS):
                    self.add({"kind": "attribute", "symbol": f"{LAYER_CLASS}.{sub.attr}", "at": self.at(sub)})
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f, target, bound = node.func, None, False
        if isinstance(f, ast.Attribute) and self.cls:
            base = self.cls[1]
            if isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name) and f.value.func.id == "super":
                target, bound = f"{base}.{f.attr}", True
            elif isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr not in self.own_methods:
                target, bound = f"{base}.{f.attr}", True
        if target is None:
            target = _dotted(f, self.aliases)
        if target:
            self.add(_call_use(node, target, self.gates, self.consts, self.at(node), [], bound))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        target = _dotted(node, self.aliases)
        if target and isinstance(node.ctx, ast.Load) and target.count(".") > 0 and not isinstance(node.value, ast.Attribute):
            self.add({"kind": "attribute", "symbol": target, "at": self.at(node)})
        self.generic_visit(node)


def _params(args: ast.arguments) -> list[list]:
    """A signature as [name, kind, has_default] (kinds: pos_only, pos, var_pos, kw_only, var_kw)."""
    pos = args.posonlyargs + args.args
    first_default = len(pos) - len(args.defaults)
    out = [[a.arg, "pos_only" if i < len(args.posonlyargs) else "pos", i >= first_default] for i, a in enumerate(pos)]
    if args.vararg:
        out.append([args.vararg.arg, "var_pos", True])
    out += [[a.arg, "kw_only", d is not None] for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        out.append([args.kwarg.arg, "var_kw", True])
    return out


def _decorators(d: ast.FunctionDef) -> list[str]:
    return sorted(x.id if isinstance(x, ast.Name) else getattr(x, "attr", "?") for x in d.decorator_list)


def plugin_uses(repo: Path = REPO) -> dict:
    """{"uses": [...], "gates": {name: {symbol, arg}}} of every module in ``MODULES``."""
    uses, gates = [], {}
    for rel in MODULES:
        tree = ast.parse((repo / rel).read_text())
        w = _Walker(rel, tree)
        w.visit(tree)
        uses += w.uses
        gates |= w.gates
    return {"uses": uses, "gates": gates}


def symbols_of(uses: dict) -> set[str]:
    """Every vLLM symbol the uses need a manifest entry for."""
    out = {u["symbol"] for u in uses["uses"]} | {g["symbol"] for g in uses["gates"].values()}
    return out | {LAYER_CLASS}


# ---- a vLLM release's source ------------------------------------------------------------------------------------

class Source:
    """The ``vllm`` package under ``root`` (an unpacked wheel), read with ``ast`` alone."""

    def __init__(self, root: Path):
        self.root, self.trees = Path(root), {}

    def file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            p = self.file(module)
            tree = ast.parse(p.read_text()) if p else None
            if tree is not None:  # the package a relative import in it starts from
                tree.package = module if p.name == "__init__.py" else module.rpartition(".")[0]
            self.trees[module] = tree
        return self.trees[module]

    def rel(self, module: str, node: ast.AST | None = None) -> str:
        p = self.file(module).relative_to(self.root).as_posix()
        return f"{p}:{node.lineno}" if node is not None else p

    def resolve(self, dotted: str, depth: int = 0) -> dict | None:
        """A dotted name -> {kind: module|function|class|value, module, node}, following re-exports."""
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):  # the longest prefix that is a module
            module = ".".join(parts[:i])
            if self.file(module):
                break
        else:
            return None
        found = {"kind": "module", "module": module, "node": None}
        for name in parts[i:]:
            found = self._member(found, name, depth)
            if found is None:
                return None
        return found

    def _member(self, owner: dict, name: str, depth: int) -> dict | None:
        if owner["kind"] == "module":
            sub = f"{owner['module']}.{name}"
            hit = _top_level(self.tree(owner["module"]), name)
            if hit is None:
                return {"kind": "module", "module": sub, "node": None} if self.file(sub) else None
            if isinstance(hit, tuple) and depth < 20:  # an import: (module, name or None)
                mod, attr = hit
                return self.resolve(mod if attr is None else f"{mod}.{attr}", depth + 1)
            kind = "class" if isinstance(hit, ast.ClassDef) else (
                "function" if isinstance(hit, (ast.FunctionDef, ast.AsyncFunctionDef)) else "value")
            return {"kind": kind, "module": owner["module"], "node": hit}
        if owner["kind"] == "class":
            return self.class_member(owner, name)
        return None

    def bases(self, cls: dict) -> list[dict]:
        """A class's bases that are vLLM classes (resolved in the class's module)."""
        out = []
        for b in cls["node"].bases:
            name = _expr_name(b)
            hit = self._name_in(cls["module"], name) if name else None
            if hit and hit["kind"] == "class":
                out.append(hit)
        return out

    def _name_in(self, module: str, name: str) -> dict | None:
        head, *rest = name.split(".")
        hit = self._member({"kind": "module", "module": module, "node": None}, head, 0)
        for r in rest:
            hit = self._member(hit, r, 0) if hit else None
        return hit

    def mro(self, cls: dict) -> list[dict]:
        out, todo = [], [cls]
        while todo:
            c = todo.pop(0)
            if all(c["node"] is not o["node"] for o in out):
                out.append(c)
                todo += self.bases(c)
        return out

    def class_member(self, cls: dict, name: str) -> dict | None:
        for c in self.mro(cls):
            for node in c["node"].body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return {"kind": "method", "module": c["module"], "node": node, "owner": c["node"].name}
                if _binds(node, name):
                    return {"kind": "value", "module": c["module"], "node": node, "owner": c["node"].name}
            for node in ast.walk(c["node"]):  # self.NAME = ... in any method
                if (isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                        isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                        and t.value.id == "self" for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))):
                    return {"kind": "value", "module": c["module"], "node": node, "owner": c["node"].name}
        return None

    def abstract(self, cls: dict) -> list[str]:
        """The abstract methods a subclass of ``cls`` must define (declared in its vLLM MRO, not defined lower)."""
        out, done = [], set()
        for c in self.mro(cls):
            for node in c["node"].body:
                if isinstance(node, ast.FunctionDef) and node.name not in done:
                    done.add(node.name)
                    if "abstractmethod" in _decorators(node):
                        out.append(node.name)
        return sorted(out)

    def init_params(self, cls: dict) -> tuple[list, str]:
        """A class's constructor parameters (self left out): its ``__init__``, or its annotated fields."""
        init = self.class_member(cls, "__init__")
        if init and init["kind"] == "method":
            return _params(init["node"].args)[1:], f"{init['owner']}.__init__"
        fields, typed_dict = [], any(_is_typeddict(c) for c in self.mro(cls))  # its keys: all optional here
        for c in reversed(self.mro(cls)):
            for node in c["node"].body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    fields.append([node.target.id, "pos", node.value is not None or typed_dict])
        return fields, "fields"


def _is_typeddict(cls: dict) -> bool:
    return any(_expr_name(b) in ("TypedDict", "typing.TypedDict") for b in cls["node"].bases)


def _expr_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _expr_name(node.value)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Subscript):  # Generic[T]
        return _expr_name(node.value)
    return None


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def _top_level(tree: ast.Module | None, name: str):
    """What binds ``name`` at a module's top level (inside if/try blocks too): a def/class/assignment node, or an
    import as (module, name or None); a lazy ``MODULE_ATTRS``-style table of "module:attr" strings counts too."""
    if tree is None:
        return None
    todo, lazy = list(tree.body), None
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + [
                s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        elif _binds(node, name):
            return node
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if (a.asname or a.name) == name:
                    return (_absolute(tree, node), a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname == name:
                    return (a.name, None)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and lazy is None:
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant) and ":" in str(v.value):
                    lazy = tuple(str(v.value).split(":"))
    if lazy:
        mod, attr = lazy
        return (_relative(tree, mod) if mod.startswith(".") else mod, attr)
    return None


def _absolute(tree: ast.Module, node: ast.ImportFrom) -> str:
    return _relative(tree, "." * node.level + (node.module or "")) if node.level else node.module


def _relative(tree: ast.Module, mod: str) -> str:
    """A relative module name in the module ``tree`` (``tree.package``: the package its name resolves against)."""
    level = len(mod) - len(mod.lstrip("."))
    base = tree.package.split(".")
    base = base[: len(base) - level + 1] if level > 1 else base
    rest = mod.lstrip(".")
    return ".".join(base + ([rest] if rest else []))


# ---- the manifest and the check ---------------------------------------------------------------------------------

def manifest(src: Source, version: str, uses: dict) -> dict:
    """Each symbol the uses need, as this vLLM source defines it (or listed as missing)."""
    symbols, missing, added = {}, [], []
    overrides = {u["symbol"] for u in uses["uses"] if u["kind"] == "override"}
    for name in sorted(symbols_of(uses)):
        hit = src.resolve(name)
        if hit is None:  # an override vLLM's base lacks is a method the plugin adds
            (added if name in overrides and name not in _used(uses, "override") else missing).append(name)
            continue
        entry = {"kind": hit["kind"], "at": src.rel(hit["module"], hit["node"]) if hit["node"] else src.rel(hit["module"])}
        node = hit["node"]
        if hit["kind"] in ("function", "method"):
            entry |= {"params": _params(node.args), "decorators": _decorators(node)}
        elif hit["kind"] == "class":
            params, origin = src.init_params(hit)
            entry |= {"init": params, "init_from": origin, "abstract": src.abstract(hit)}
        symbols[name] = entry
    return {"vllm": version, "generated_by": "benchmarks/vllm_api.py build", "symbols": symbols, "missing": missing,
            "added_by_the_plugin": added}


def _used(uses: dict, *but: str) -> set[str]:
    """The symbols of every use other than those of kinds ``but``."""
    return {u["symbol"] for u in uses["uses"] if u["kind"] not in but}


def _holds(when: list, gates: dict, symbols: dict) -> bool:
    for gate, value in when:
        g = gates[gate]
        params = symbols.get(g["symbol"], {}).get("params", [])
        if (g["arg"] in [p[0] for p in params]) != value:
            return False
    return True


def _call_problem(use: dict, entry: dict, gates: dict, symbols: dict) -> str | None:
    if entry["kind"] == "class":
        params = entry["init"]
    elif entry["kind"] in ("function", "method"):
        params = entry["params"]
        static, cls = "staticmethod" in entry["decorators"], "classmethod" in entry["decorators"]
        if entry["kind"] == "method" and not static and (use["bound"] or cls):
            params = params[1:]
    else:
        return None  # a value (an instance, a registry): nothing to compare
    names = {p[0]: p for p in params if p[1] in ("pos", "kw_only")}
    positional = [p for p in params if p[1] in ("pos_only", "pos")]
    var_pos, var_kw = (any(p[1] == k for p in params) for k in ("var_pos", "var_kw"))
    if use["positional"] > len(positional) and not var_pos:
        return f"{use['positional']} positional arguments, it takes {len(positional)}"
    filled = {p[0] for p in positional[:use["positional"]]}
    for kw, when in use["keywords"]:
        if when and not _holds([when], gates, symbols):
            continue
        if kw in filled:
            return f"{kw!r} given twice"
        if kw not in names and not var_kw:
            return f"no parameter {kw!r}"
        filled.add(kw)
    if not use["opaque"]:
        required = [p[0] for p in params if not p[2] and p[1] not in ("var_pos", "var_kw") and p[0] not in filled]
        if required:
            return f"required parameters not given: {', '.join(required)}"
    return None


def _override_problem(use: dict, entry: dict) -> str | None:
    """Whether vLLM can call the override as it calls its base's method (constructors are the plugin's own)."""
    if entry["kind"] != "method" or use["symbol"].endswith(".__init__"):
        return None
    on_class = {"staticmethod", "classmethod"}
    base_static, over_static = "staticmethod" in entry["decorators"], "staticmethod" in use["decorators"]
    if on_class & set(entry["decorators"]) and not on_class & set(use["decorators"]):
        return f"vLLM's is a {'/'.join(sorted(on_class & set(entry['decorators'])))}, the override is not"
    base = entry["params"] if base_static else entry["params"][1:]
    over = use["params"] if over_static else use["params"][1:]
    over_names = {p[0] for p in over if p[1] in ("pos", "kw_only", "pos_only")}
    over_var_pos, over_var_kw = (any(p[1] == k for p in over) for k in ("var_pos", "var_kw"))
    n_base = sum(p[1] in ("pos_only", "pos") for p in base)
    n_over = sum(p[1] in ("pos_only", "pos") for p in over)
    if n_over < n_base and not over_var_pos:
        return f"takes {n_over} positional parameters, vLLM's {n_base}"
    lost = [p[0] for p in base if p[1] in ("pos", "kw_only") and p[0] not in over_names and not over_var_kw]
    if lost:
        return f"lacks vLLM's parameters {lost}"
    base_names = {p[0] for p in base}
    extra = [p[0] for p in over if not p[2] and p[1] not in ("var_pos", "var_kw") and p[0] not in base_names]
    return f"requires parameters vLLM's does not pass: {extra}" if extra else None


def check(uses: dict, man: dict) -> list[str]:
    """One line per problem of the uses against one manifest."""
    symbols, missing, gates, out = man["symbols"], set(man["missing"]), uses["gates"], []
    unknown = sorted(symbols_of(uses) - set(symbols) - missing - set(man["added_by_the_plugin"]))
    if unknown:
        out.append(f"vLLM {man['vllm']}: the manifest lacks {unknown}: rebuild it (benchmarks/vllm_api.py build)")
    for use in uses["uses"]:
        if not _holds(use["when"], gates, symbols):
            continue
        name, entry, where = use["symbol"], symbols.get(use["symbol"]), f"vLLM {man['vllm']}: {use['at']}"
        if use["kind"] == "override":
            why = _override_problem(use, entry) if entry else None
            if why:
                out.append(f"{where}: override of {name}: {why}")
            continue
        if entry is None:
            if name in missing:
                out.append(f"{where}: {name} is not in vLLM {man['vllm']}")
            continue
        if use["kind"] == "subclass":
            lacking = sorted(set(entry["abstract"]) - set(use["defines"]))
            if lacking:
                out.append(f"{where}: {use['class']} does not define {name}'s abstract {lacking}")
        elif use["kind"] == "call":
            why = _call_problem(use, entry, gates, symbols)
            if why:
                out.append(f"{where}: call of {name}: {why}")
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["uses"]:
        print(json.dumps(plugin_uses(), indent=1))
        return 0
    if argv[:1] == ["build"] and len(argv) == 5 and argv[3] == "-o":
        src, version, out = Source(Path(argv[1])), argv[2], Path(argv[4])
        if src.file("vllm") is None:
            sys.exit(f"{argv[1]} holds no vllm/__init__.py (unzip a vLLM wheel's .py files there)")
        uses = plugin_uses()
        man = manifest(src, version, uses)
        out.write_text(json.dumps(man, indent=1, sort_keys=True) + "\n")
        problems = check(uses, man)
        print(f"{out}: {len(man['symbols'])} symbols, {len(man['missing'])} missing; {len(problems)} problems")
        print("\n".join(problems))
        return 1 if problems else 0
    if argv[:1] == ["check"] and len(argv) > 1:
        uses = plugin_uses()
        problems = [p for f in argv[1:] for p in check(uses, json.loads(Path(f).read_text()))]
        print("\n".join(problems) or f"the plugin's uses of vLLM agree with {', '.join(argv[1:])}")
        return 1 if problems else 0
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
