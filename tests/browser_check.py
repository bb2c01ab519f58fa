"""Open notebooks in JupyterLab in headless Chromium and report what a reader would see wrong.

Used by tests/test_browser.py. JupyterLab (this interpreter's) serves a temporary copy of the notebooks on
127.0.0.1 with a token, so that nothing it writes (autosave of a notebook marked modified, workspaces,
settings) reaches the checkout. Chromium is driven over its DevTools protocol (websocket-client, already a
dependency of jupyter_server), one page per notebook, at a fixed window size.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

CHROMIUM_VARIABLE = "TWELL_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
# The window the checks and the screenshots use: a laptop screen.
WINDOW = (1440, 900)


def find_chromium() -> str | None:
    """``$TWELL_CHROMIUM`` or the first Chromium-like browser on PATH (Debian's package installs ``chromium``)."""
    given = os.environ.get(CHROMIUM_VARIABLE)
    if given:
        return given if Path(given).is_file() else shutil.which(given)
    return next(filter(None, (shutil.which(n) for n in CHROMIUM_NAMES)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Lab:
    """A running JupyterLab: ``url(path)`` opens ``path`` (relative to ``root``) in a fresh workspace."""

    root: Path
    port: int
    token: str
    process: subprocess.Popen
    log: Path

    def url(self, path: str, workspace: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/workspaces/{workspace}/tree/{path}?reset&token={self.token}"

    def api(self, method: str, route: str) -> object:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/{route}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_sessions(self) -> None:
        for s in self.api("GET", "sessions") or []:
            self.api("DELETE", f"sessions/{s['id']}")


@contextlib.contextmanager
def jupyterlab(root: Path, home: Path, timeout: float = 90) -> Iterator[Lab]:
    """JupyterLab on 127.0.0.1 serving ``root``, its settings, workspaces and kernels' user paths under
    ``home`` (windowing off, so that every cell is laid out and checked, not only those on screen)."""
    settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    apputils = home / "settings" / "@jupyterlab" / "apputils-extension"
    apputils.mkdir(parents=True)  # no news or update pop-up over the screenshots
    (apputils / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                           "checkForUpdates": False}))
    env = {**os.environ,
           "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "JUPYTER_PATH": "", "MPLBACKEND": "agg"}
    port, token = _free_port(), secrets.token_hex(16)
    log = home / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
           "--ServerApp.open_browser=False", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
           "jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers, CI
        cmd.append("--allow-root")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)
    lab = Lab(root, port, token, proc, log)

    def up():
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return lab.api("GET", "status")
        except OSError:
            return None

    try:
        _wait(up, timeout, "JupyterLab to answer")
        yield lab
    finally:
        with contextlib.suppress(Exception):
            lab.shutdown_sessions()
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """End a server this check started: terminate, then kill if it has not exited after 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


class Page:
    """One Chromium page over the DevTools protocol (commands answered in order, events skipped)."""

    def __init__(self, ws_url: str):
        import websocket  # websocket-client

        self._ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self._id = 0

    def send(self, method: str, **params) -> dict:
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str):
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails'].get('exception', res['exceptionDetails'])}")
        return res["result"].get("value")

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self._ws.close()


@contextlib.contextmanager
def chromium(executable: str, home: Path, timeout: float = 60) -> Iterator[Page]:
    """Headless Chromium with a fresh profile under ``home``; yields its first page at :data:`WINDOW`."""
    profile = home / "chromium-profile"
    cmd = [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--no-default-browser-check", "--hide-scrollbars", f"--user-data-dir={profile}",
           "--remote-debugging-port=0", f"--window-size={WINDOW[0]},{WINDOW[1]}", "about:blank"]
    log = home / "chromium.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    page = None
    try:
        def port():
            if proc.poll() is not None:
                raise RuntimeError(f"{executable} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            f = profile / "DevToolsActivePort"
            text = f.read_text() if f.is_file() else ""
            return text.split()[0] if text.strip() else None

        p = _wait(port, timeout, "Chromium's DevTools port")
        targets = _wait(lambda: [t for t in json.load(urllib.request.urlopen(f"http://127.0.0.1:{p}/json/list"))
                                 if t["type"] == "page"], timeout, "a Chromium page")
        page = Page(targets[0]["webSocketDebuggerUrl"])
        page.send("Page.enable")
        page.send("Emulation.setDeviceMetricsOverride", width=WINDOW[0], height=WINDOW[1], deviceScaleFactor=1,
                  mobile=False)
        yield page
    finally:
        if page is not None:
            with contextlib.suppress(Exception):
                page.close()
        _stop(proc)


# Runs in the page: the open notebook's state once it is ready, else null. Problems are strings naming the cell.
_STATE_JS = r"""
(() => {
  const app = window.jupyterapp;
  if (!app || !app.shell) return null;
  const panel = app.shell.currentWidget || [...app.shell.widgets('main')][0];  // headless: no focus
  if (!panel || !panel.content || !panel.context || !panel.context.isReady) return null;
  const session = panel.sessionContext;
  if (!session || !session.isReady) return null;
  const kernel = session.session && session.session.kernel;
  const status = kernel ? kernel.status : 'none';
  if (status !== 'idle') return null;
  const nb = panel.content;
  const cells = nb.widgets;
  if (!cells.length || cells.some(c => !c.isConnected && !c.node.isConnected)) return null;
  const problems = [];
  const images = [];
  cells.forEach((cell, i) => {
    const where = `cell ${i + 1}`;
    const model = cell.model;
    if (model.type === 'code') {
      const outs = model.outputs;
      for (let j = 0; j < outs.length; j++) {
        const o = outs.get(j);
        if (o.type === 'error') problems.push(`${where}: error output ${o.toJSON().ename}: ${o.toJSON().evalue}`);
      }
    }
    const area = cell.node.querySelector('.jp-OutputArea') || cell.node;
    const text = area.innerText || '';
    if (/Error displaying widget|Error rendering output|Javascript Error/.test(text))
      problems.push(`${where}: widget or render error: ${text.match(/(Error displaying widget|Error rendering output|Javascript Error)[^\n]*/)[0]}`);
    cell.node.querySelectorAll('table').forEach(t => {
      const cut = [...t.querySelectorAll('th, td')].map(c => c.textContent.trim()).filter(x => /(\.\.\.|\u2026)$/.test(x));
      if (cut.length) problems.push(`${where}: table with hidden rows, columns or text ("..." in ${cut.length} cells: ${cut[0].slice(-40)})`);
      const box = t.parentElement.closest('.jp-OutputArea-output, .jp-MarkdownOutput, .jp-RenderedHTMLCommon');
      const limit = (box || cell.node).clientWidth;
      if (t.scrollWidth > limit + 1) problems.push(`${where}: table ${t.scrollWidth} px wide in ${limit} px`);
    });
    cell.node.querySelectorAll('img').forEach(img => {
      if (!img.complete) { images.push('loading'); return; }
      const shown = img.getBoundingClientRect().width;
      const wanted = parseFloat(img.getAttribute('width')) || img.naturalWidth;
      if (!img.naturalWidth) problems.push(`${where}: image not loaded`);
      else if (shown + 1 < wanted) problems.push(`${where}: image shown ${Math.round(shown)} px wide, ${Math.round(wanted)} px intended`);
      images.push(Math.round(shown));
    });
  });
  if (images.includes('loading')) return null;
  const tab = document.querySelector('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current');
  return {dirty: panel.context.model.dirty, tabDirty: !!(tab && tab.classList.contains('jp-mod-dirty')),
          kernel: session.kernelDisplayName, cells: cells.length, images, problems,
          title: panel.title.label};
})()
"""


@dataclass
class NotebookView:
    """What opening one notebook showed: ``problems`` lists everything the check fails on."""

    path: str
    cells: int = 0
    kernel: str = ""
    problems: list[str] = field(default_factory=list)


def open_notebook(page: Page, lab: Lab, path: str, workspace: str, screenshot: Path | None = None,
                  settle: float = 3.0, timeout: float = 120) -> NotebookView:
    """Open ``path`` in a fresh workspace, wait until it is rendered and its kernel idle, wait ``settle``
    seconds more (a notebook that changes on opening changes then), and collect the problems."""
    page.send("Page.navigate", url=lab.url(path, workspace))
    _wait(lambda: page.evaluate(_STATE_JS), timeout, f"{path} to open with an idle kernel", interval=0.5)
    time.sleep(settle)
    state = page.evaluate(_STATE_JS) or _wait(lambda: page.evaluate(_STATE_JS), timeout, f"{path} again")
    view = NotebookView(path, state["cells"], state["kernel"], list(state["problems"]))
    if state["dirty"] or state["tabDirty"]:
        view.problems.insert(0, f"marked modified on opening (kernel {state['kernel']!r})")
    if screenshot is not None:
        page.evaluate("(() => { const app = window.jupyterapp; const n = (app.shell.currentWidget || "
                  "[...app.shell.widgets('main')][0]).content; n.activeCellIndex = 0; n.node.scrollTop = 0; "
                  "return true; })()")
        time.sleep(0.5)
        page.screenshot(screenshot)
    return view


def check_notebooks(chromium_path: str, repo: Path, notebooks: list[str], screenshots: Path | None = None
                    ) -> list[NotebookView]:
    """Open every notebook of ``notebooks`` (paths relative to ``repo``) from a temporary copy; with
    ``screenshots``, save ``<screenshots>/<name>.png`` of the first page of each executed copy (those under
    ``reports/``: the sources have no outputs to show)."""
    with tempfile.TemporaryDirectory(prefix="twell-browser-") as tmp:
        tmp = Path(tmp)
        root, home = tmp / "root", tmp / "home"
        home.mkdir()
        for rel in notebooks:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / rel, root / rel)
        views = []
        with jupyterlab(root, home) as lab, chromium(chromium_path, home) as page:
            for i, rel in enumerate(notebooks):
                shot = None if screenshots is None or Path(rel).parts[0] != "reports" else \
                    screenshots / f"{Path(rel).stem}.png"
                views.append(open_notebook(page, lab, rel, f"check{i}", shot))
                lab.shutdown_sessions()
        for rel, view in zip(notebooks, views):
            if (root / rel).read_bytes() != (repo / rel).read_bytes():
                view.problems.append("the file changed on disk while open (autosave of a modified notebook)")
        return views


