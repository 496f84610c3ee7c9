#!/usr/bin/env bash
# Builds and checks Tandem on a CUDA machine that has PyTorch (a CUDA
# LibTorch) but no package registry, as the GPU machines lent to this project
# are. Cap'n Proto, libuv and doctest come as Debian .deb files in .device/
# (tools/fetch_gpu_deps.sh downloads them, on a machine that reaches Debian's
# package registry; carry .device/ along with the tree) and are unpacked into
# /opt/deps, never over /.
#
#   tools/gpu_session.sh build         configure + build build-cuda/ (keeps going past errors)
#   tools/gpu_session.sh gpu-tests     the test cases that need a GPU, by name
#   tools/gpu_session.sh ctest         every test (ctest -j8)
#   tools/gpu_session.sh bench         rpc_bench --device cuda and PyTorch's anchor
#   tools/gpu_session.sh STAGE...      several, in order; logs go to $OUT when it is set
#
# TARGETS="a b" builds only those; CTEST_REGEX picks the tests ctest runs.
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
out=${OUT:-build-cuda/logs}
mkdir -p "$out" /opt/deps
if [[ ! -f /opt/deps/.unpacked ]]; then
  compgen -G '.device/*.deb' >/dev/null ||
    { echo "gpu_session: no .deb files in .device/ (run tools/fetch_gpu_deps.sh where apt reaches Debian)" >&2; exit 1; }
  for f in .device/*.deb; do dpkg -x "$f" /opt/deps; done
  touch /opt/deps/.unpacked
fi
export PATH=/opt/deps/usr/bin:$PATH
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
# Their .pc files say prefix=/usr: pkg-config puts /opt/deps in front.
export PKG_CONFIG_SYSROOT_DIR=/opt/deps
export PKG_CONFIG_PATH=/opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/share/pkgconfig
py=$(command -v python3)
status=0

stage_build() {
  local torch_cmake nccl
  torch_cmake=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  nccl=$("$py" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
  {
    echo "== machine"; nvidia-smi -L; g++ --version | head -1; cmake --version | head -1
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      "cxx11abi", torch.compiled_with_cxx11_abi(), "nccl", torch.cuda.nccl.version())'
    echo "nccl root: $nccl"
  } 2>&1 | tee "$out/machine.txt"
  rm -f build-cuda/CMakeCache.txt
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_cmake;/opt/deps/usr" \
    -DCapnProto_DIR=/opt/deps/usr/lib/x86_64-linux-gnu/cmake/CapnProto \
    -DCAPNP_EXECUTABLE=/opt/deps/usr/bin/capnp -DCAPNPC_CXX_EXECUTABLE=/opt/deps/usr/bin/capnpc-c++ \
    -DCAPNPC_IMPORT_DIRS=/opt/deps/usr/include \
    ${nccl:+-DNCCL_ROOT=$nccl} 2>&1 | tee "$out/configure.log" || return 1
  [[ -f build-cuda/build.ninja ]] || return 1
  cmake --build build-cuda -j"$(nproc)" ${TARGETS:+--target $TARGETS} -- -k 0 2>&1 |
    tee "$out/build.log" | grep -E 'error|FAILED' | head -80
  return "${PIPESTATUS[0]}"
}

stage_gpu_tests() {
  local b=build-cuda/bin t failed=0
  # The cases that need a GPU, by name, in each test binary that was built.
  {
    for t in test_rpc test_autograd test_nn test_pipeline test_optim test_ddp; do
      [[ -x $b/$t ]] || continue
      $b/$t -tc="*CUDA*,*cuda*,*GPU*,*device map*,*nccl*" || failed=1
    done
    exit "$failed"  # (this group is a subshell of the pipeline)
  } 2>&1 | tee "$out/gpu_tests.log"
  return "${PIPESTATUS[0]}"
}

stage_ctest() {
  (cd build-cuda && ctest -j8 --timeout 300 --output-on-failure ${CTEST_REGEX:+-R "$CTEST_REGEX"}) 2>&1 |
    tee "$out/ctest.log" | tail -40
}

stage_bench() {
  {
    build-cuda/bin/rpc_bench --device cuda
    PYTHONUNBUFFERED=1 "$py" bench/anchors/rpc_echo_cuda.py
  } 2>&1 | tee "$out/bench.jsonl"
}

for stage in "$@"; do
  echo "==== $stage ($(date +%T))"
  case $stage in
    build) stage_build || { status=1; break; } ;;
    gpu-tests) stage_gpu_tests || status=1 ;;
    ctest) stage_ctest || status=1 ;;
    bench) stage_bench || status=1 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $status
