"""Which code made a benchmark result.

A benchmark JSON records digests of the code it ran (``meta["code"]``): the kernel sources in csrc/
and the Python package src/twell, each a hash of file names and contents only (no toolchain, no
paths), plus the checkout's commit and whether the files equal it. That commit is no proof of what
ran: a copy of the working tree on a GPU machine can carry an older ``.git`` (the last landed
commit, with everything newer reported as "local changes"), and a copy may have none. The
digests are what ties a JSON to a tree: :func:`matching_commits` recomputes them from git objects
and lists the commits that match.

``python -m twell.bench provenance FILE.json`` prints that list.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
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
    where = ("no git checkout: `python -m twell.bench provenance` on the JSON finds the matching commits"
             if code.get("commit") is None else
             f"commit {code['commit'][:10]}" + {True: "", False: " with local changes",
                                                None: " (unknown whether the files match it)"}[code.get("matches_commit")])
    return f"Code: csrc {code.get('csrc')}, package {code.get('package')}; {where}."
