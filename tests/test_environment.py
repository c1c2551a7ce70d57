"""Environment variables are read or set only where docs/architecture.md says (its ``<!-- environment: ... -->``
list): a new module that touches ``os.environ`` or ``os.getenv`` fails here until the map names it, and a module the
map names that no longer does fails too, so the map stays true of the code."""

import ast
import re

from tests.conftest import REPO

PACKAGE = REPO / "quant"


def _touches_environment(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv", "putenv", "unsetenv") for a in node.names):
            return True
    return False


def test_environment_is_touched_only_where_the_architecture_map_says():
    text = (REPO / "docs" / "architecture.md").read_text()
    (listed,) = re.findall(r"<!-- environment: ([^>]*?) -->", text)
    named = set(listed.split())
    found = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if _touches_environment(ast.parse(p.read_text(), str(p)))}
    assert found - named == set(), f"modules that touch the environment but docs/architecture.md does not name: {found - named}"
    assert named - found == set(), f"docs/architecture.md names modules that no longer touch the environment: {named - found}"


def test_the_check_sees_every_way_of_reaching_the_environment():
    for code in ("import os\nos.environ.get('X')", "import os\nos.getenv('X')", "from os import environ\n",
                 "import os\nx = {**os.environ}"):
        assert _touches_environment(ast.parse(code)), code
    assert not _touches_environment(ast.parse("import os\nos.path.join('a')"))
