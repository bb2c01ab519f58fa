"""Code digests in benchmark results (twell.bench.provenance) and the CLI that maps them to commits."""
import json
import platform
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

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
    now = pv.provenance()
    assert {k: meta["code"][k] for k in now} == now  # this checkout, unchanged since the run
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


# -- run_meta: the environment block of every benchmark, and the tree it ran from --------------------------------
def _repo(root, files=BASE):
    _git(root, "init", "-q")
    _tree(root, files)
    return _commit(root, "base")


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """Refusal as for a GPU run, on this CPU."""
    monkeypatch.setattr(pv, "refuses_dirty", lambda device: True)


def test_only_gpu_runs_are_refused_by_default():
    assert pv.refuses_dirty(torch.device("cuda")) and pv.refuses_dirty("cuda:1")
    assert not pv.refuses_dirty(torch.device("cpu")) and not pv.refuses_dirty("cpu")


@needs_git
def test_run_meta_of_a_clean_checkout(tmp_path, monkeypatch, as_on_a_gpu):
    head = _repo(tmp_path)
    monkeypatch.setattr(sys, "argv", ["twell.bench", "ffn", "--tag", "a b"])
    meta = pv.run_meta("cpu", root=tmp_path)  # a clean tree is never refused
    code = meta["code"]
    assert code["repository"] is True and code["dirty"] is False and code["commit"] == head
    assert code["changed"] == [] and code["changed_count"] == 0 and code["diff_digest"] is None
    assert code["matches_commit"] is True and code["csrc"] == pv.tree_digests(tmp_path)["csrc"]
    assert meta["argv"] == ["twell.bench", "ffn", "--tag", "a b"] and meta["command"] == "twell.bench ffn --tag 'a b'"
    assert meta["python"] == platform.python_version() and meta["torch"] == torch.__version__
    assert meta["cuda"] == torch.version.cuda and meta["device"] == "cpu" and meta["allow_dirty"] is False
    assert datetime.fromisoformat(meta["timestamp"]).tzinfo is not None
    assert pv.code_line(code).endswith(f"commit {head[:10]}.") and pv.dirty_line(meta) is None


@needs_git
def test_a_dirty_tree_is_refused_unless_allowed_and_then_marked(tmp_path, as_on_a_gpu):
    head = _repo(tmp_path)
    (tmp_path / "src/twell/m/mod.py").write_text("x = 2")
    with pytest.raises(pv.DirtyTreeError, match=r"1 paths .* differ from commit .*src/twell/m/mod.py"):
        pv.run_meta("cpu", root=tmp_path)
    meta = pv.run_meta("cpu", root=tmp_path, allow_dirty=True)
    code = meta["code"]
    assert meta["allow_dirty"] is True and code["dirty"] is True and code["commit"] == head
    assert code["changed"] == [" M src/twell/m/mod.py"] and code["changed_count"] == 1
    assert f"commit {head[:10]} with local changes (1 paths, diff digest {code['diff_digest']})" in pv.code_line(code)
    assert pv.dirty_line(meta).startswith("> LOCAL CHANGES (allowed by allow_dirty): 1 paths")
    # The digest is of the changes themselves: another edit of the same file is another tree.
    (tmp_path / "src/twell/m/mod.py").write_text("x = 3")
    assert pv.run_meta("cpu", root=tmp_path, allow_dirty=True)["code"]["diff_digest"] != code["diff_digest"]


@needs_git
def test_a_cpu_run_from_a_dirty_tree_is_marked_not_refused(tmp_path):
    _repo(tmp_path)
    (tmp_path / "csrc/a.cu").unlink()
    meta = pv.run_meta("cpu", root=tmp_path)
    assert meta["code"]["dirty"] is True and meta["code"]["changed"] == [" D csrc/a.cu"]
    assert "(not refused: not a GPU run)" in pv.dirty_line(meta)


@needs_git
def test_what_makes_a_tree_dirty(tmp_path):
    _repo(tmp_path, {**BASE, "reports/bench/old.json": "{}", "docs/a.md": "text", ".gitignore": "*.so\n"})
    assert pv.tree_state(tmp_path)["dirty"] is False
    # Results the benchmarks write (reports/) and ignored build files are not the code that ran.
    (tmp_path / "reports/bench/new.json").write_text("{}")
    (tmp_path / "reports/bench/old.json").write_text("{\"changed\": 1}")
    (tmp_path / "csrc/ext.so").write_bytes(b"\0")
    assert pv.tree_state(tmp_path)["dirty"] is False
    # Any other change counts, code or not, tracked or not; an untracked file's content is in the digest.
    (tmp_path / "docs/a.md").write_text("edited")
    (tmp_path / "notes.txt").write_text("one")
    state = pv.tree_state(tmp_path)
    assert state["dirty"] is True and state["changed"] == [" M docs/a.md", "?? notes.txt"]
    (tmp_path / "notes.txt").write_text("two")
    assert pv.tree_state(tmp_path)["diff_digest"] != state["diff_digest"]
    _git(tmp_path, "mv", "docs/a.md", "docs/b.md")  # a rename lists the new path once
    assert pv.tree_state(tmp_path)["changed"] == ["RM docs/b.md", "?? notes.txt"]


@needs_git
def test_a_repository_without_a_commit_is_dirty(tmp_path, as_on_a_gpu):
    _git(tmp_path, "init", "-q")
    _tree(tmp_path, BASE)
    state = pv.tree_state(tmp_path)
    assert state["repository"] is True and state["dirty"] is True and state["changed_count"] == len(BASE)
    with pytest.raises(pv.DirtyTreeError, match="no commit yet"):
        pv.run_meta("cpu", root=tmp_path)
    assert pv.code_line(pv.run_meta("cpu", root=tmp_path, allow_dirty=True)["code"]).endswith(
        "a git repository without a commit.")


def test_run_meta_without_a_repository_records_that_and_does_not_refuse(tmp_path, as_on_a_gpu):
    _tree(tmp_path, BASE)  # a copy of the tree without .git
    meta = pv.run_meta("cpu", root=tmp_path)
    code = meta["code"]
    assert code["repository"] is False and code["dirty"] is None and code["commit"] is None
    assert code["csrc"] == pv.tree_digests(tmp_path)["csrc"] and "package_dir" not in code
    assert "no git checkout" in pv.code_line(code) and pv.dirty_line(meta) is None


@needs_git
def test_a_copy_inside_another_checkout_is_no_repository(tmp_path, as_on_a_gpu):
    _repo(tmp_path, {"README": "outer"})
    inner = tmp_path / "copy"
    _tree(inner, BASE)  # untracked in the outer repository, which is dirty: not this tree's state
    meta = pv.run_meta("cpu", root=inner)
    assert meta["code"]["repository"] is False and meta["code"]["commit"] is None


def test_run_meta_of_an_installed_package_digests_the_imported_modules(tmp_path, as_on_a_gpu):
    import twell

    meta = pv.run_meta("cpu", root=tmp_path)  # no checkout here: as when twell is installed and run elsewhere
    package = Path(twell.__file__).resolve().parent
    assert meta["code"]["repository"] is False and meta["code"]["package_dir"] == str(package)
    # Named as in a checkout, so the digest compares with git's (this checkout's own src/twell here).
    assert meta["code"]["package"] == pv.tree_digests(package.parents[1])["package"]
    assert f"package imported from {package}" in pv.code_line(meta["code"])


@needs_git
@pytest.mark.parametrize("bench", ["ffn", "decode", "model"])
def test_bench_entry_points_refuse_a_dirty_tree_before_measuring(bench, tmp_path, monkeypatch, as_on_a_gpu):
    from twell.bench import decode, ffn, model

    _repo(tmp_path)
    (tmp_path / "csrc/a.cu").write_text("edited")
    monkeypatch.setattr(pv, "repo_root", lambda: tmp_path)

    def measured(*args, **kwargs):
        raise AssertionError("measured before the tree was checked")

    monkeypatch.setattr(decode, "calibrated_ffn_inputs", measured)
    monkeypatch.setattr(model, "_load", measured)
    monkeypatch.setattr(ffn.BenchRunner, "capture", measured)
    run = {
        "ffn": lambda **kw: ffn.BenchRunner(ffn.BenchConfig(device="cpu", shapes="odd", cases=("nnz8",), D=64,
                                                            odd_M=20, odd_H=100, reps=1, energy=False),
                                            progress=False, **kw).run(),
        "decode": lambda **kw: decode.run_decode_bench(decode.DecodeBenchConfig(rows=(1,), cases=("nnz8",), D=64,
                                                                                H=100, device="cpu"), False, **kw),
        "model": lambda **kw: model.run_model_bench(model.ModelBenchConfig(checkpoint="nowhere", device="cpu"),
                                                    False, **kw),
    }[bench]
    with pytest.raises(pv.DirtyTreeError, match="csrc/a.cu"):
        run()
    with pytest.raises(AssertionError, match="measured before"):  # allowed: it goes on to measure
        run(allow_dirty=True)


@needs_git
def test_an_installed_package_run_in_another_projects_checkout_records_no_commit(tmp_path, as_on_a_gpu):
    _repo(tmp_path, {"README": "another project"})
    (tmp_path / "README").write_text("edited")  # that project's changes are not this run's
    meta = pv.run_meta("cpu", root=tmp_path)
    assert meta["code"]["repository"] is False and meta["code"]["commit"] is None
    assert meta["code"]["matches_commit"] is None and meta["code"]["dirty"] is None
