"""One link rule for a run directory, at any depth, in every command that reads or writes one: ``quant run`` (and
its ``--dry-run``), the stage commands (``quant eval``), ``quant inspect`` of a run's checkpoint and
``quant publish`` refuse a symbolic link anywhere in the run directory with the same one line, and nothing is
read or written through it. Names that are not UTF-8, or hold newlines, are plain data to all of them."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quant.cli import _one_line, cli_exit_code
from quant.errors import QuantError
from quant.publish import publish_run
from tests.conftest import REPO
from tests.test_publish import SERVED, FakeHub

RECIPE = str(REPO / "recipes" / "mixed_int8_int4.yaml")
SETS = [a for o in SERVED for a in ("--set", o)]
ODD_NAMES = (b"caf\xe9", b"new\nline", b" lead and trail ", b"-dash", b"\xff\xfe", "ünïcödé".encode(), b"x" * 200,
             b"%s{}$(id)")


@pytest.fixture(scope="module")
def finished(quant_cache, tmp_path_factory) -> Path:
    """A run that passed its gates and that transformers serves (publishable)."""
    d = tmp_path_factory.mktemp("links") / "finished"
    code, err = _cli("run", RECIPE, "-o", str(d), *SETS)
    assert code == 0, err
    return d


def _cli(*argv: str) -> tuple[int, str]:
    """``quant ARGV`` in this process: (exit code, what it printed on stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_exit_code(list(argv))
    return code, err.getvalue()


def _publish(d: Path, hub_root: Path) -> tuple[int, str]:
    """``quant publish`` through a local hub (the CLI's command minus the network client)."""
    try:
        publish_run(d, "acme/tiny", api=FakeHub(hub_root))
    except QuantError as e:
        return e.exit_code, f"error: {_one_line(str(e))}"  # as the CLI prints it
    return 0, ""


def _answers(d: Path, hub_root: Path) -> dict[str, tuple[int, str]]:
    return {"inspect": _cli("inspect", str(d / "checkpoint")), "publish": _publish(d, hub_root),
            "dry-run": _cli("run", RECIPE, "-o", str(d), *SETS, "--dry-run"),
            "eval": _cli("eval", RECIPE, "-o", str(d), *SETS), "run": _cli("run", RECIPE, "-o", str(d), *SETS)}


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def _tree(root: Path) -> dict[bytes, bytes | None]:
    """Every entry under ``root`` (no link followed): name -> content digest (None for a folder or a link)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            digest = None if p.is_symlink() or p.is_dir() else hashlib.sha256(p.read_bytes()).digest()
            out[os.fsencode(p.relative_to(root))] = digest
    return out


def _entries(d: Path) -> list[Path]:
    return sorted((Path(dp) / n for dp, dns, fns in os.walk(d) for n in dns + fns), key=os.fsencode)


@pytest.mark.parametrize("where", ["checkpoint/config.json", "checkpoint/model.safetensors", "checkpoint",
                                   "eval.json", "quantized"])
def test_a_link_to_an_identical_copy_is_refused_by_every_command(finished, tmp_path, where):
    """A run directory entry replaced by a link to an identical copy outside it: before, ``quant run`` reported
    nothing to do and kept a link inside checkpoint/, and ``quant publish`` uploaded through it (checkpoint/ itself
    a link as well)."""
    d, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(finished, d)
    outside.mkdir()
    shutil.move(d / where, outside / "copy")
    (d / where).symlink_to(outside / "copy", target_is_directory=(outside / "copy").is_dir())
    before = _tree(outside)
    answers = _answers(d, tmp_path / "hub")
    lines = {cmd: _error_lines(err) for cmd, (_, err) in answers.items()}
    assert all(code == 1 for code, _ in answers.values()), answers
    assert all(len(v) == 1 for v in lines.values()), answers
    assert len({v[0] for v in lines.values()}) == 1, lines  # the same answer from every command
    assert f"{d / where} is a symbolic link" in lines["run"][0]
    assert not (tmp_path / "hub").exists()  # nothing uploaded
    assert _tree(outside) == before and (d / where).is_symlink()


def test_a_checkpoint_outside_a_run_directory_may_be_made_of_links(finished, tmp_path):
    """A hub download keeps its files as links into a blob store: ``quant inspect`` reads it."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(finished / "checkpoint", blobs)
    snapshot.mkdir()
    for f in blobs.iterdir():
        (snapshot / f.name).symlink_to(f)
    code, err = _cli("inspect", str(snapshot))
    assert code == 0, err


def test_names_that_are_not_utf8_are_data_to_every_command(finished, tmp_path):
    """A stray file with a non-UTF-8 name in the quantized store: the freshness hash read it as text and failed."""
    d = tmp_path / "run"
    shutil.copytree(finished, d)
    (d / "quantized" / os.fsdecode(b"stray-\xe9")).write_bytes(b"x")
    answers = _answers(d, tmp_path / "hub")
    assert answers["run"][0] == 0, answers["run"]
    assert all("internal error" not in err and "Traceback" not in err for _, err in answers.values()), answers


_MUTATION = st.tuples(st.sampled_from(("file_to_copy", "dir_to_copy", "dangling", "loop", "odd_file", "odd_dir")),
                      st.integers(0, 10**6), st.sampled_from(ODD_NAMES))


def _mutate(d: Path, outside: Path, kind: str, pick: int, odd: bytes) -> bool:
    """Apply one change at a random depth of ``d``; whether it left a link in the run directory."""
    entries = _entries(d)
    files = [p for p in entries if p.is_file() and not p.is_symlink()]
    dirs = [d] + [p for p in entries if p.is_dir() and not p.is_symlink()]
    name = os.fsdecode(odd)
    if kind == "file_to_copy" and files:
        src = files[pick % len(files)]
        copy = outside / f"f{pick}"
        shutil.move(src, copy)
        src.symlink_to(copy)
        return True
    if kind == "dir_to_copy" and len(dirs) > 1:
        src = dirs[1:][pick % (len(dirs) - 1)]
        copy = outside / f"d{pick}"
        shutil.move(src, copy)
        src.symlink_to(copy, target_is_directory=True)
        return True
    parent = dirs[pick % len(dirs)]
    if (parent / name).exists() or (parent / name).is_symlink():
        return False
    if kind == "dangling":
        (parent / name).symlink_to(outside / "nothing-here")
    elif kind == "loop":
        (parent / name).symlink_to(parent, target_is_directory=True)
    elif kind == "odd_file":
        (parent / name).write_bytes(odd)
        return False
    else:
        (parent / name).mkdir()
        (parent / name / name).write_bytes(odd)
        return False
    return True


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(mutations=st.lists(_MUTATION, min_size=1, max_size=3))
def test_every_command_gives_the_same_answer_on_links_and_odd_names(finished, mutations):
    """Random run directories: links (to copies, dangling, looping) and odd names at random depths. With a link,
    every command refuses with the same one line naming a link, and what lies outside is untouched; without one,
    no command fails on a name (``run`` repairs what changed and exits 0)."""
    root = Path(tempfile.mkdtemp(prefix="links-", dir=finished.parent))
    try:
        d, outside = root / "run", root / "outside"
        shutil.copytree(finished, d)
        outside.mkdir()
        linked = [_mutate(d, outside, *m) for m in mutations]
        before = _tree(outside)
        answers = _answers(d, root / "hub")
        assert all("internal error" not in err and "Traceback" not in err for _, err in answers.values()), answers
        if any(linked):
            lines = {cmd: _error_lines(err) for cmd, (_, err) in answers.items()}
            assert all(code == 1 and len(lines[cmd]) == 1 for cmd, (code, _) in answers.items()), answers
            assert len({v[0] for v in lines.values()}) == 1, lines
            assert " is a symbolic link; " in lines["run"][0]
            assert not (root / "hub").exists() and _tree(outside) == before
        else:
            assert answers["run"][0] == 0, answers["run"]
            assert all(code == 0 or len(_error_lines(err)) == 1 for code, err in answers.values()), answers
    finally:
        shutil.rmtree(root)
