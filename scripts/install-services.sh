#!/usr/bin/env bash
# Installs the system packages the test suite needs, where they are missing.
# Each connector that talks to a real service adds its package here.
set -euo pipefail
need=()
for pkg in "$@"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install-services: missing Debian packages: ${need[*]} (run as root, or install them)" >&2
    exit 1
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi
echo "install-services: system services ready"
