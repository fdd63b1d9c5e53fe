#!/bin/sh
# Installs what the C example needs (libzmq's headers from Debian), once.
set -e
if pkg-config --exists libzmq 2>/dev/null && command -v cc >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq libzmq3-dev pkg-config gcc >/dev/null
