#!/bin/sh
# Installs, once, the Debian packages the test suite needs beyond PyPI: libzmq's
# headers and a compiler for the C example client, and FUSE 3 for the power-cut
# rig (tests/power; it skips, saying why, where FUSE cannot be mounted).
set -e
if pkg-config --exists libzmq 2>/dev/null && command -v cc >/dev/null 2>&1 \
        && command -v fusermount3 >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq libzmq3-dev pkg-config gcc fuse3 >/dev/null
