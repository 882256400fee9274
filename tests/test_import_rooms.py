"""The rooms of DESIGN.md import one way: plugins import neither builder nor runtime, and the runtime never
imports the builder (that the scheduler / pool bookkeeping needs no tensors: tests/runtime/test_request.py)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = {"k3build": ROOT / "k3build", "k3plugins": ROOT / "plugins", "k3runtime": ROOT / "runtime"}
FORBIDDEN = {"k3plugins": {"k3build", "k3runtime"}, "k3runtime": {"k3build"}, "k3build": {"k3runtime"}}


def _imports(path: Path, package: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(package if node.level else (node.module or "").split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
                found.add(arg.value.split(".")[0])
    return found


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_rooms_import_one_way(room):
    bad = []
    for path in ROOMS[room].rglob("*.py"):
        wrong = _imports(path, room) & FORBIDDEN[room]
        bad += [f"{path.relative_to(ROOT)} imports {w}" for w in sorted(wrong)]
    assert not bad, "\n".join(bad)


def test_walker_sees_a_wrong_edge(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import k3build.config\nfrom k3build import mapping\n")
    assert "k3build" in _imports(bad, "k3runtime")
