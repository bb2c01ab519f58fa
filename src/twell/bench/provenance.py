"""Which code made a benchmark result, and from which tree.

A benchmark JSON records digests of the code it ran (``meta["code"]``): the kernel sources in csrc/
and the Python package src/twell, each a hash of file names and contents only (no toolchain, no
paths), plus the checkout's commit and whether the files equal it. That commit is no proof of what
ran: a copy of the working tree on a GPU machine can carry an older ``.git`` (the last landed
commit, with everything newer reported as "local changes"), and a copy may have none. The
digests are what ties a JSON to a tree: :func:`matching_commits` recomputes them from git objects
and lists the commits that match.

:func:`run_meta` is the environment block every benchmark writes (versions, device, command line,
time, the code above and the state of the tree: local changes and a digest of them). A GPU run from
a tree with local changes is refused unless the caller allows it (``allow_dirty``), and is then
marked in the JSON and in its markdown (:func:`dirty_line`).

``python -m twell.bench provenance FILE.json`` prints that list.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterable

from twell.kernels.build import HEADER_SUFFIXES, SOURCE_SUFFIXES
from twell.paths import repo_root

KERNEL_SUFFIXES = SOURCE_SUFFIXES + HEADER_SUFFIXES  # what the extension is built from
PARTS = {"csrc": ("csrc", KERNEL_SUFFIXES), "package": ("src/twell", (".py",))}


def digest(files: Iterable[tuple[str, bytes]]) -> str:
    """16 hex chars of sha256 over (relative name, content) pairs, in name order. CRLF counts as LF, so
    a checkout that converts line ends digests as git's objects do."""
    h = hashlib.sha256()
    for name, data in sorted(files):
        for part in (name.encode("utf-8", "surrogateescape"), data.replace(b"\r\n", b"\n")):
            h.update(f"{len(part)}:".encode())
            h.update(part)
    return h.hexdigest()[:16]


def _selected(names: Iterable[str], prefix: str, suffixes: tuple[str, ...]) -> list[str]:
    # csrc/ is flat (the extension takes csrc/*); the package is every module below src/twell.
    flat = prefix == "csrc"
    out = []
    for n in names:
        rel = n[len(prefix) + 1:] if n.startswith(prefix + "/") else None
        if rel and n.endswith(suffixes) and (not flat or "/" not in rel) and "__pycache__" not in rel:
            out.append(n)
    return out


def tree_digests(root: Path | None = None) -> dict[str, str]:
    """Digests of csrc and the package as the files lie on disk under ``root`` (default: this checkout)."""
    root = Path(root) if root is not None else repo_root()
    out = {}
    for key, (prefix, suffixes) in PARTS.items():
        names = [p.relative_to(root).as_posix() for p in (root / prefix).rglob("*") if p.is_file() or p.is_symlink()]
        out[key] = digest((n, _disk_bytes(root / n)) for n in _selected(names, prefix, suffixes))
    return out


def _disk_bytes(path: Path) -> bytes:
    # git stores a symbolic link as the path it points to, not as the target's content.
    return os.readlink(path).encode() if path.is_symlink() else path.read_bytes()


def _git(root: Path, *args: str, binary: bool = False) -> str | bytes | None:
    try:
        res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    return res.stdout if binary else res.stdout.decode().strip()


def provenance(root: Path | None = None) -> dict:
    """What ``meta["code"]`` of a benchmark JSON holds: the digests, the checkout's commit (None without
    one) and whether the digested files equal that commit's (``matches_commit``; None without a commit)."""
    root = Path(root) if root is not None else repo_root()
    code = tree_digests(root)
    # Only a repository whose top is this tree: a copy inside another checkout is not that checkout.
    top = _git(root, "rev-parse", "--show-toplevel")
    commit = (_git(root, "rev-parse", "HEAD") if top and Path(top).resolve() == root.resolve() else None) or None
    same = None
    if commit is not None:
        try:
            same = digests_at(commit, root) == code
        except (ValueError, subprocess.SubprocessError):
            same = None
    return {**code, "commit": commit, "matches_commit": same}


def _blob_lists(root: Path, commit: str) -> dict[str, list[tuple[str, str]]]:
    """Per part, the (name, blob id) pairs of ``commit`` that the digest covers."""
    out = {}
    for key, (prefix, suffixes) in PARTS.items():
        listing = _git(root, "ls-tree", "-r", "-z", commit, "--", prefix, binary=True)
        if listing is None:
            raise ValueError(f"git cannot list {prefix} at {commit!r} in {root}")
        blobs = {}  # name -> blob id; -z: names unquoted, entries "mode type id\tname\0"
        for entry in listing.decode("utf-8", "surrogateescape").split("\0"):
            if entry:
                info, name = entry.split("\t", 1)
                _, kind, blob = info.split()
                if kind == "blob":
                    blobs[name] = blob
        out[key] = [(n, blobs[n]) for n in _selected(blobs, prefix, suffixes)]
    return out


def _read_blobs(root: Path, ids: Iterable[str]) -> dict[str, bytes]:
    """Contents of many blobs through one ``git cat-file --batch``."""
    ids = sorted(set(ids))
    if not ids:
        return {}
    try:
        res = subprocess.run(["git", "-C", str(root), "cat-file", "--batch"], input="\n".join(ids).encode() + b"\n",
                             capture_output=True, timeout=120, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"git cat-file failed in {root}: {exc}") from None
    out, pos, data = {}, 0, res.stdout
    for blob in ids:
        end = data.find(b"\n", pos)
        head = data[pos:end].decode(errors="replace").split() if end >= 0 else []
        if len(head) != 3 or head[0] != blob or head[1] != "blob":
            raise ValueError(f"git cat-file has no blob {blob} in {root} (answered {' '.join(head) or 'nothing'})")
        oid, kind, size = head
        pos = end + 1
        out[blob] = data[pos:pos + int(size)]
        pos += int(size) + 1  # the content, then a newline
    return out


def _digests(lists: dict[str, list[tuple[str, str]]], contents: dict[str, bytes]) -> dict[str, str]:
    """Per part, the digest of its (name, blob id) pairs, given the blobs' contents."""
    return {key: digest((n, contents[b]) for n, b in pairs) for key, pairs in lists.items()}


def digests_at(commit: str, root: Path | None = None) -> dict[str, str]:
    """The digests of :func:`tree_digests`, from the files of ``commit`` in git."""
    root = Path(root) if root is not None else repo_root()
    lists = _blob_lists(root, commit)
    return _digests(lists, _read_blobs(root, (b for pairs in lists.values() for _, b in pairs)))


def matching_commits(code: dict, root: Path | None = None, max_count: int = 500) -> list[tuple[str, str, bool]]:
    """(commit, subject, package matches too) for the newest ``max_count`` commits whose csrc digest
    equals ``code["csrc"]``, newest first."""
    root = Path(root) if root is not None else repo_root()
    log = _git(root, "log", f"--max-count={max_count}", "--format=%H %s")
    if log is None:
        raise ValueError(f"no git history in {root}")
    commits = [line.partition(" ")[::2] for line in log.splitlines()]
    lists = {c: _blob_lists(root, c) for c, _ in commits}
    contents = _read_blobs(root, (b for parts in lists.values() for pairs in parts.values() for _, b in pairs))
    out = []
    for commit, subject in commits:
        d = _digests(lists[commit], contents)
        if d["csrc"] == code.get("csrc"):
            out.append((commit, subject, d["package"] == code.get("package")))
    return out


def code_line(code: dict) -> str:
    """One line for a report: the digests and what they say about the commit."""
    if code.get("commit") is None and code.get("repository"):
        where = "a git repository without a commit"
    elif code.get("commit") is None:
        where = ("no git checkout: `python -m twell.bench provenance` on the JSON finds the matching commits"
                 + (f" (package imported from {code['package_dir']})" if code.get("package_dir") else ""))
    elif "dirty" in code:  # written by run_meta: the whole tree was checked, not only the digested files
        where = f"commit {code['commit'][:10]}" + (
            f" with local changes ({code.get('changed_count')} paths, diff digest {code.get('diff_digest')})"
            if code["dirty"] else "")
    else:
        where = f"commit {code['commit'][:10]}" + {True: "", False: " with local changes", None: " (unknown "
                                                   "whether the files match it)"}[code.get("matches_commit")]
    return f"Code: csrc {code.get('csrc')}, package {code.get('package')}; {where}."


# ------------------------------------------------------------------ the tree a run comes from
# Where the benchmarks write their records: outputs of a run, not what it executes, so a result not yet
# committed there does not make the next run's tree dirty.
OUTPUT_DIR = "reports/"
_NOT_OUTPUT = ("--", ".", f":(exclude){OUTPUT_DIR}")
MAX_CHANGED = 50  # paths listed in a record; the count and the digest cover all of them


class DirtyTreeError(ValueError):
    """A benchmark whose record would be refused: its tree has local changes and ``allow_dirty`` is off."""


def tree_state(root: Path | None = None) -> dict:
    """Whether ``root`` is a git checkout of this project and what differs from its HEAD outside reports/.

    ``repository``: False for an installed package or a copy without (or inside another) ``.git``; then
    ``dirty`` is None (unknown). Otherwise ``dirty`` is True when a tracked file differs from HEAD, an
    untracked file that git does not ignore exists, or there is no commit at all; ``changed`` lists the first
    ``MAX_CHANGED`` of ``git status --porcelain`` ("XY path"), ``changed_count`` counts them all, and
    ``diff_digest`` hashes ``git diff HEAD`` with the untracked files' names and contents, so two records
    with the same commit and digest ran the same tree."""
    root = Path(root) if root is not None else repo_root()
    none = {"repository": False, "dirty": None, "changed": [], "changed_count": 0, "diff_digest": None}
    top = _git(root, "rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != root.resolve() or not (root / "src" / "twell").is_dir():
        return none
    commit = _git(root, "rev-parse", "--verify", "-q", "HEAD") or None
    status = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all", *_NOT_OUTPUT, binary=True)
    if status is None:
        return {**none, "repository": True, "note": "git status failed"}
    entries, tokens = [], iter(status.decode("utf-8", "surrogateescape").split("\0"))
    for token in tokens:
        if not token:
            continue
        entries.append(token)
        if token[0] in "RC":  # a rename or copy: the next token is the path it came from
            next(tokens, None)
    untracked = sorted(e[3:] for e in entries if e.startswith("??"))
    diff = b""
    if commit is not None:
        diff = _git(root, "diff", "--binary", "--no-ext-diff", "--no-textconv", "HEAD", *_NOT_OUTPUT,
                    binary=True) or b""
    dirty = bool(entries) or commit is None
    # The empty name cannot be a path, so the diff's entry never collides with an untracked file's.
    changes = [("", diff), *((name, _readable(root / name)) for name in untracked)]
    return {"repository": True, "dirty": dirty, "changed": entries[:MAX_CHANGED], "changed_count": len(entries),
            "diff_digest": digest(changes) if dirty else None}


def _readable(path: Path) -> bytes:
    try:
        return _disk_bytes(path)
    except OSError:  # removed between git status and now: the name still counts
        return b""


def _package_digest(package_dir: Path) -> str:
    """The package digest of an imported (installed) twell: its modules named as in a checkout (src/twell/...),
    so that :func:`matching_commits` can compare it."""
    names = [p.relative_to(package_dir).as_posix() for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts]
    return digest((f"src/twell/{n}", _disk_bytes(package_dir / n)) for n in names)


def refuses_dirty(device) -> bool:
    """Whether a run on ``device`` is refused from a tree with local changes: GPU runs, whose JSONs are the
    records. A CPU run is a test of the code whose report says it holds no GPU numbers; it is marked, not refused."""
    return getattr(device, "type", str(device).split(":")[0]) == "cuda"


def run_meta(device=None, *, allow_dirty: bool = False, root: Path | None = None) -> dict:
    """The environment block of a benchmark JSON, taken when the run starts.

    Keys: ``timestamp`` (UTC, ISO), ``host``, ``python``, ``torch``, ``cuda`` (the CUDA torch was built with),
    ``device``, ``device_name``, ``argv`` and ``command`` (the command line), ``code`` (:func:`provenance`
    and :func:`tree_state` of ``root``, default this checkout; without a checkout the package digest is of
    the imported package and ``package_dir`` says where it lies) and ``allow_dirty``; on a GPU also
    ``cudnn`` and ``driver``.

    Raises :class:`DirtyTreeError` when the tree has local changes, :func:`refuses_dirty` holds for the
    device and ``allow_dirty`` is False. Without a git repository nothing can be checked: recorded, not refused.
    """
    import torch

    dev = torch.device(device if device is not None else "cpu")
    root = Path(root) if root is not None else repo_root()
    state = tree_state(root)
    code = provenance(root)
    if not state["repository"]:
        code.update(commit=None, matches_commit=None)  # a commit of an enclosing repository is not this tree's
        if not (root / "src" / "twell").is_dir():
            import twell

            package_dir = Path(twell.__file__).resolve().parent
            code.update(package=_package_digest(package_dir), package_dir=str(package_dir))
    code.update(state)
    if code["dirty"] and not allow_dirty and refuses_dirty(dev):
        shown = ", ".join(e[3:] for e in code["changed"][:5]) + (", ..." if code["changed_count"] > 5 else "")
        where = f"commit {code['commit'][:10]}" if code["commit"] else "no commit yet"
        raise DirtyTreeError(
            f"refusing to record a benchmark from a tree with local changes ({code['changed_count']} paths outside "
            f"{OUTPUT_DIR} differ from {where}: {shown}); commit them first, or allow it (allow_dirty=True, "
            "--allow-dirty) and the record is marked as such")
    argv = list(sys.argv)
    meta = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "argv": argv,
        "command": shlex.join(argv),
        "code": code,
        "allow_dirty": bool(allow_dirty),
    }
    if dev.type == "cuda":
        meta["cudnn"] = torch.backends.cudnn.version()
        meta["driver"] = _driver_version()
    return meta


def _driver_version() -> str | None:
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    return None


def dirty_line(meta: dict) -> str | None:
    """The banner of a report whose run came from a tree with local changes (None for a clean or unknown tree)."""
    code = meta.get("code") or {}
    if not code.get("dirty"):
        return None
    why = "allowed by allow_dirty" if meta.get("allow_dirty") else "not refused: not a GPU run"
    base = f"commit {code['commit'][:10]}" if code.get("commit") else "no commit"
    return (f"> LOCAL CHANGES ({why}): {code.get('changed_count')} paths differ from {base} (diff digest "
            f"{code.get('diff_digest')}); these numbers are not that commit's alone.")
