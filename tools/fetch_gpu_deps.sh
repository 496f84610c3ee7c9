#!/usr/bin/env bash
# Downloads into .device/ the Debian packages that a GPU machine without a
# package registry lacks for building Tandem: Cap'n Proto (headers, CMake
# config, library, and the capnp compiler), libuv (headers and library),
# doctest, and Gloo's headers (PyTorch's wheels build Gloo into libtorch_cpu
# but ship none of its headers; gpu_session.sh takes the headers alone).
# tools/gpu_session.sh unpacks them into /opt/deps there.
#
# Run it on a machine that reaches Debian's package registry (Debian 12, as the
# .debs must match what gpu_session.sh expects); it only downloads, installs
# nothing. Then carry .device/ to the GPU machine along with the tree and run
#   tools/gpu_session.sh build
#
#   tools/fetch_gpu_deps.sh            fetch (replaces the .debs already in .device/)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

# The runtime library's package carries the version in its name
# (libcapnp-0.9.2 on Debian 12): take it from libcapnp-dev's dependencies.
capnp_lib=$(apt-cache depends libcapnp-dev 2>/dev/null |
  sed -n 's/^ *Depends: \(libcapnp-[0-9][0-9.]*\)$/\1/p' | head -1)
if [[ -z $capnp_lib ]]; then
  echo "fetch_gpu_deps: libcapnp-dev is not known to apt here (apt-get update?)" >&2
  exit 1
fi
packages=(libcapnp-dev "$capnp_lib" capnproto libuv1-dev libuv1 doctest-dev libgloo-dev)

# Download to a folder of its own first, so a failed fetch leaves the old set
# whole. apt-get download writes to the current folder as the _apt user when
# that user can: the folder is open to it.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 777 "$tmp"
(cd "$tmp" && apt-get download "${packages[@]}")
mkdir -p .device
rm -f .device/*.deb
mv "$tmp"/*.deb .device/
echo "fetch_gpu_deps: in .device/:"
ls -1 .device/*.deb
