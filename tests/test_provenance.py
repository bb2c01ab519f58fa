"""Code digests in benchmark results (twell.bench.provenance) and the CLI that maps them to commits."""
import json
import shutil
import subprocess

import pytest

from twell.bench import provenance as pv
from twell.bench.__main__ import main as bench_main


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _git(root, *args):
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _commit(root, message):
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", message)
    return _git(root, "rev-parse", "HEAD")


BASE = {"csrc/a.cu": "kernel A", "csrc/b.cuh": "header", "csrc/README.md": "prose", "csrc/sub/x.cu": "not built",
        "src/twell/__init__.py": "", "src/twell/m/mod.py": "x = 1", "src/twell/data.json": "{}"}


def test_digest_depends_on_names_and_contents_not_order():
    a = pv.digest([("a", b"1"), ("b", b"2")])
    assert a == pv.digest([("b", b"2"), ("a", b"1")])
    assert a != pv.digest([("a", b"1"), ("b", b"3")])
    assert a != pv.digest([("a", b"1"), ("c", b"2")])
    assert pv.digest([("ab", b"c")]) != pv.digest([("a", b"bc")])  # lengths are part of the hash


def test_tree_digests_cover_what_is_built_and_imported(tmp_path):
    _tree(tmp_path, BASE)
    d0 = pv.tree_digests(tmp_path)
    # Files the extension and the package never read leave the digests alone.
    for name in ("csrc/README.md", "csrc/sub/x.cu", "src/twell/data.json"):
        (tmp_path / name).write_text("changed")
        assert pv.tree_digests(tmp_path) == d0, name
    (tmp_path / "csrc/b.cuh").write_text("header 2")
    d1 = pv.tree_digests(tmp_path)
    assert d1["csrc"] != d0["csrc"] and d1["package"] == d0["package"]
    (tmp_path / "src/twell/m/new.py").write_text("")
    assert pv.tree_digests(tmp_path)["package"] != d1["package"]


def test_provenance_without_git(tmp_path):
    _tree(tmp_path, BASE)
    code = pv.provenance(tmp_path)
    assert code["commit"] is None and code["matches_commit"] is None
    assert code["csrc"] == pv.tree_digests(tmp_path)["csrc"]
    assert "no git checkout" in pv.code_line(code)


@needs_git
def test_provenance_and_matching_commits_in_a_repository(tmp_path):
    _git(tmp_path, "init", "-q")
    _tree(tmp_path, BASE)
    first = _commit(tmp_path, "first")
    code1 = pv.provenance(tmp_path)
    assert code1["commit"] == first and code1["matches_commit"] is True
    assert pv.digests_at(first, tmp_path) == pv.tree_digests(tmp_path)
    (tmp_path / "src/twell/m/mod.py").write_text("x = 2")
    assert pv.provenance(tmp_path)["matches_commit"] is False
    assert "with local changes" in pv.code_line(pv.provenance(tmp_path))
    second = _commit(tmp_path, "package only")
    (tmp_path / "csrc/a.cu").write_text("kernel A2")
    third = _commit(tmp_path, "kernel change")
    # Newest first; the kernels of code1 are those of the first two commits, its package the first's.
    assert pv.matching_commits(code1, tmp_path) == [(second, "package only", False), (first, "first", True)]
    assert pv.matching_commits(pv.provenance(tmp_path), tmp_path) == [(third, "kernel change", True)]
    assert pv.matching_commits({"csrc": "0" * 16}, tmp_path) == []
    assert pv.matching_commits(code1, tmp_path, max_count=1) == []


@needs_git
def test_names_git_quotes_symlinks_and_crlf_digest_as_in_git(tmp_path):
    _git(tmp_path, "init", "-q")
    _tree(tmp_path, {**BASE, "src/twell/modé.py": "y = 1", "src/twell/a\tb.py": "z = 1", ".gitattributes": "* text=auto\n"})
    (tmp_path / "csrc/crlf.cuh").write_bytes(b"line 1\r\nline 2\r\n")  # git stores LF (text=auto)
    (tmp_path / "src/twell/link.py").symlink_to("m/mod.py")
    commit = _commit(tmp_path, "odd files")
    assert _git(tmp_path, "cat-file", "-p", f"{commit}:csrc/crlf.cuh") == "line 1\nline 2"
    code = pv.provenance(tmp_path)
    assert code["matches_commit"] is True, (code, pv.digests_at(commit, tmp_path))
    assert pv.matching_commits(code, tmp_path) == [(commit, "odd files", True)]
    # The odd names are in the digest: removing one changes it.
    (tmp_path / "src/twell/a\tb.py").unlink()
    assert pv.provenance(tmp_path)["matches_commit"] is False


@needs_git
def test_a_tree_inside_another_checkout_records_no_commit(tmp_path):
    _git(tmp_path, "init", "-q")
    _tree(tmp_path, {"README": "outer"})
    _commit(tmp_path, "outer")
    inner = tmp_path / "copy"
    _tree(inner, BASE)
    code = pv.provenance(inner)
    assert code["commit"] is None and code["matches_commit"] is None


def test_cli_reads_a_result_and_rejects_one_without_digests(tmp_path, capsys):
    assert bench_main(["ffn", "--shapes", "odd", "--cases", "nnz8", "--D", "64", "--odd-M", "20", "--odd-H", "100",
                       "--reps", "1", "--out", str(tmp_path), "--quiet", "--tag", "p"]) == 0
    (js,) = tmp_path.glob("ffn-*-p.json")
    meta = json.loads(js.read_text())["meta"]
    assert meta["code"] == pv.provenance()  # this checkout, unchanged since the run
    assert pv.code_line(meta["code"]) in js.with_suffix(".md").read_text()
    capsys.readouterr()
    if meta["code"]["commit"] is None:  # a copy of the tree without .git
        with pytest.raises(SystemExit, match="no git history"):
            bench_main(["provenance", str(js)])
    else:
        code = bench_main(["provenance", str(js)])
        out = capsys.readouterr().out
        assert out.startswith(pv.code_line(meta["code"]))
        # HEAD's kernels are these unless csrc has uncommitted edits: then no commit may be listed.
        if pv.digests_at("HEAD")["csrc"] == meta["code"]["csrc"]:
            assert code == 0 and f"{meta['code']['commit'][:10]}  kernels" in out
        else:
            assert code == 1 and "no commit" in out
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"meta": {"timestamp": "t"}}))
    with pytest.raises(SystemExit, match="no code digests"):
        bench_main(["provenance", str(old)])
    with pytest.raises(SystemExit, match="cannot read"):
        bench_main(["provenance", str(tmp_path / "missing.json")])
