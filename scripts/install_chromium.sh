#!/usr/bin/env bash
# Headless Chromium for the browser check (tests/test_browser.py), from the distribution's packages.
# Never fails the caller: without apt-get or root it says why and the check skips with its reason.
set -uo pipefail
for name in chromium chromium-browser google-chrome; do
  if command -v "$name" >/dev/null; then echo "browser check: $(command -v "$name") present"; exit 0; fi
done
if ! command -v apt-get >/dev/null; then
  echo "browser check: no apt-get here; install Chromium yourself or set TWELL_CHROMIUM (the check skips)"; exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "browser check: not root and no sudo: apt-get install chromium by hand (the check skips)"; exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; then
  echo "browser check: installed $(command -v chromium)"
else
  echo "browser check: apt-get could not install chromium (the check skips)"
fi
exit 0
