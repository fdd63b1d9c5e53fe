#!/bin/sh
# Installs, once, what the test suite needs beyond PyPI: from Debian, libzmq's headers
# and a compiler for the C example client, FUSE 3 for the power-cut rig
# (tests/power; it skips, saying why, where FUSE cannot be mounted), and Chromium with
# its WebDriver for the console's browser test (tests/admin); from npm, nsqjs
# for the client-compatibility test of the lookup daemon (tests/lookupd/nsqjs; it
# skips, saying why, where npm is missing).
set -e
cd "$(dirname "$0")/.."
if ! { pkg-config --exists libzmq 2>/dev/null && command -v cc >/dev/null 2>&1 \
        && command -v fusermount3 >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1 \
        && command -v chromedriver >/dev/null 2>&1; }; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq libzmq3-dev pkg-config gcc fuse3 chromium chromium-driver \
        >/dev/null
fi
if command -v npm >/dev/null 2>&1 && [ ! -d tests/lookupd/nsqjs/node_modules/nsqjs ]; then
    npm ci --prefix tests/lookupd/nsqjs --no-audit --no-fund --loglevel=error >/dev/null
fi
