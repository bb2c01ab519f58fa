"""The package's layers depend one way: a module may import its own layer and those below, never above.

    0  twell (the package root), paths, jsonl, progress, timing, config_util: foundations that
       every layer may use
    1  formats, data: the TwELL formats; the corpora and their tokenisation (beside the formats, below
       the model: a run's data is prepared without building a model)
    2  reference: the pure-PyTorch TwELL ops
    3  kernels: the CUDA ops (same signatures as the reference)
    4  nn: SparseFFN, on either
    5  model: the Llama model built of SparseFFN layers
    6  bench, train, eval, reports, pipeline, cli: the top (they may use one another; cli holds the
       argument and input checks the command-line tools share, the kernels' availability among them)

A ``__main__`` module is a command-line entry point: nothing imports it, so it sits at the top whatever
its package (``python -m twell.data`` reads a run config of twell.train).

Every import counts, at module level or inside a function, ``from twell import x`` naming the module
x, relative imports and ``importlib.import_module("twell....")`` with a literal name.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

TOP = 6
LAYERS = {
    "twell": 0, "twell.paths": 0, "twell.jsonl": 0, "twell.progress": 0, "twell.timing": 0, "twell.config_util": 0,
    "twell.formats": 1, "twell.data": 1,
    "twell.reference": 2,
    "twell.kernels": 3,
    "twell.nn": 4,
    "twell.model": 5,
    "twell.bench": TOP, "twell.train": TOP, "twell.eval": TOP, "twell.reports": TOP, "twell.pipeline": TOP,
    "twell.cli": TOP,
}


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The layer of the longest entry of LAYERS that is ``module`` or a package holding it."""
    if module.rsplit(".", 1)[-1] == "__main__":
        return TOP
    parts = module.split(".")
    for n in range(len(parts), 1, -1):  # down to twell.<x>: the root's entry is the root alone
        name = ".".join(parts[:n])
        if name in LAYERS:
            return LAYERS[name]
    return LAYERS.get(module)


def imports(path: Path, module: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported twell module) of every import in the file at ``path`` (the module ``module``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # "from twell import kernels" imports the module twell.kernels, not only the package.
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base) for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    # one entry per module and line: "from twell.x import a, b" is one import of twell.x
    return [(line, name) for line, name in dict.fromkeys(found) if name == "twell" or name.startswith("twell.")]


def violations(src: Path) -> list[str]:
    files = sorted((src / "twell").rglob("*.py"))
    known = {module_name(f, src) for f in files}
    out = []
    for f in files:
        me = module_name(f, src)
        mine = layer_of(me)
        if mine is None:
            out.append(f"{f.relative_to(src)}: module {me} has no layer in LAYERS (tests/test_layering.py)")
            continue
        for line, name in imports(f, me, known):
            theirs = layer_of(name)
            if theirs is None:
                out.append(f"{f.relative_to(src)}:{line}: imports {name}, which has no layer in LAYERS")
            elif theirs > mine:
                out.append(f"{f.relative_to(src)}:{line}: {me} (layer {mine}) imports {name} (layer {theirs})")
    return out


def test_no_layer_imports_a_higher_one():
    bad = violations(SRC)
    assert not bad, "lower layers import higher ones:\n  " + "\n  ".join(bad)


def test_the_scan_sees_the_package():
    """Every module is read, and imports inside functions are found (union_paths times with twell.timing)."""
    files = list((SRC / "twell").rglob("*.py"))
    assert len(files) > 50
    path = SRC / "twell" / "model" / "union_paths.py"
    known = {module_name(f, SRC) for f in files}
    assert "twell.timing" in {name for _, name in imports(path, "twell.model.union_paths", known)}


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "src"
    for name, text in {"twell/__init__.py": "", **files}.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    return src


@pytest.mark.parametrize("text, imported", [
    ("from twell.model.llama import sparse_ffns, capture_ffn_inputs\n", "twell.model.llama"),  # named once
    ("def f():\n    from twell.model import config\n", "twell.model.config"),
    ("import twell.model\n", "twell.model"),
    ("from twell import model\n", "twell.model"),
    ("from ..model import llama\n", "twell.model.llama"),
    ("import importlib\nm = importlib.import_module('twell.model')\n", "twell.model"),
])
def test_an_upward_import_is_named_with_file_and_line(tmp_path, text, imported):
    src = _tree(tmp_path, {"twell/data/__init__.py": "", "twell/data/prep.py": "x = 1\n" + text,
                           "twell/model/__init__.py": "", "twell/model/llama.py": "", "twell/model/config.py": ""})
    bad = violations(src)
    line = 1 + text.count("\n")  # the import is the last line, after "x = 1"
    assert bad == [f"twell/data/prep.py:{line}: twell.data.prep (layer 1) imports {imported} (layer 5)"], bad


def test_downward_and_entry_point_imports_pass_and_unknown_modules_fail(tmp_path):
    src = _tree(tmp_path, {"twell/model/__init__.py": "from twell.data import x\nfrom twell import timing\n",
                           "twell/data/__init__.py": "", "twell/timing.py": "",
                           "twell/data/__main__.py": "from twell.train.config import load_config\n",
                           "twell/train/__init__.py": "", "twell/train/config.py": ""})
    assert violations(src) == []
    (src / "twell" / "extra.py").write_text("")
    assert violations(src) == ["twell/extra.py: module twell.extra has no layer in LAYERS (tests/test_layering.py)"]
