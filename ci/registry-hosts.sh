#!/usr/bin/env bash
# Fails when a tracked file names a package registry's host. Packages come through their
# registries' own clients (pip, npm, cargo, apt-get) by name and version, so that whatever
# index, mirror, proxy or offline cache those clients are configured with serves them; a host
# written into a script or a doc bypasses that. Cargo.lock files are exempt: cargo writes the
# crate registry's source into each of their entries.
#
#     ci/registry-hosts.sh              check every tracked file
#     ci/registry-hosts.sh --self-test  check that a planted host name is caught
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# The hosts of the Python package index and its file store, the npm and yarn registries, the
# Rust crate registry and Debian's archives, written as patterns that do not match themselves.
hosts='pypi[.](org|python[.]org)|pythonhosted[.]org|npmjs[.](org|com)|yarnpkg[.]com|crates[.]io|debian[.]org'

# scan FILE...: print every line naming a host; succeed only when there is none.
scan() { ! grep -nIE -- "$hosts" "$@"; }

if [[ "${1:-}" == --self-test ]]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    printf 'clean line\n' > "$tmp/clean.txt"
    scan "$tmp/clean.txt" > /dev/null || { echo "registry-hosts: a clean file was flagged" >&2; exit 1; }
    for planted in "files.python""hosted.org/x.tar.gz" "https://registry.npm""js.org/@a/b" \
                   "static.crates"".io/crates" "http://deb.debian"".org/debian"; do
        printf 'ok\nsee %s\n' "$planted" > "$tmp/planted.txt"
        if scan "$tmp/planted.txt" > /dev/null; then
            echo "registry-hosts: the planted host in '$planted' was not caught" >&2
            exit 1
        fi
    done
    echo "registry-hosts: self-test passed (a clean file passes, four planted hosts are caught)"
    exit 0
fi

mapfile -d '' files < <(git ls-files -z -- . ':(exclude)Cargo.lock' ':(exclude)**/Cargo.lock')
if ! scan "${files[@]}"; then
    echo "registry-hosts: the lines above name a package registry's host; fetch the package" \
         "with its registry's client by name and version, and name the registry by kind" >&2
    exit 1
fi
echo "registry-hosts: no tracked file names a registry host (${#files[@]} files checked)"
