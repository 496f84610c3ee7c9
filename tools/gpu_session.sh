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
#   tools/gpu_session.sh probe         bench/cuda_ipc_probe.cu: CUDA IPC's primitives, timed
#   tools/gpu_session.sh cpu-bench     pp_dp_bench, zero_bench and zero.py, tp_bench and tp.py on the machine's cores
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
  # Gloo: its headers alone. LibTorch has Gloo built in; Debian's library
  # (and libgloo-dev's link to it) must not be linked beside it.
  rm -f /opt/deps/usr/lib/libgloo.so* /opt/deps/usr/lib/x86_64-linux-gnu/libgloo.so*
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
  local torch_cmake nccl gloo=""
  # Gloo's headers (libgloo-dev, an older Gloo than LibTorch's: ProcessGroupGloo.hpp
  # guards what newer Gloo added) keep the gloo backend in this build.
  [[ -f /opt/deps/usr/include/gloo/algorithm.h ]] && gloo=/opt/deps/usr/include
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
    ${nccl:+-DNCCL_ROOT=$nccl} ${gloo:+-DGLOO_INCLUDE_DIR=$gloo} 2>&1 | tee "$out/configure.log" || return 1
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
    timeout 180 build-cuda/bin/rpc_bench --device cuda
    PYTHONUNBUFFERED=1 timeout 180 "$py" bench/anchors/rpc_echo_cuda.py
  } 2>&1 | tee "$out/bench.jsonl"
}

stage_probe() {
  mkdir -p build-cuda
  {
    nvcc -O2 -std=c++17 -o build-cuda/cuda_ipc_probe bench/cuda_ipc_probe.cu &&
      timeout 120 build-cuda/cuda_ipc_probe
  } 2>&1 | tee "$out/probe.jsonl"
  return "${PIPESTATUS[0]}"
}

# The CPU benches whose targets ask for more cores than a development VM has.
stage_cpu_bench() {
  local b=build-cuda/bin
  {
    echo "{\"machine\":\"$(nproc) cores\"}"
    [[ -x $b/pp_dp_bench ]] && timeout 240 $b/pp_dp_bench
    [[ -x $b/zero_bench ]] && timeout 300 $b/zero_bench
    PYTHONUNBUFFERED=1 timeout 300 "$py" bench/anchors/zero.py
    # (tensor parallelism: a core a rank, beside PyTorch 2's parallelize_module)
    [[ -x $b/tp_bench ]] && timeout 240 $b/tp_bench
    PYTHONUNBUFFERED=1 timeout 300 "$py" bench/anchors/tp.py
  } 2>&1 | tee "$out/cpu_bench.jsonl"
}

for stage in "$@"; do
  echo "==== $stage ($(date +%T))"
  case $stage in
    build) stage_build || { status=1; break; } ;;
    gpu-tests) stage_gpu_tests || status=1 ;;
    ctest) stage_ctest || status=1 ;;
    bench) stage_bench || status=1 ;;
    probe) stage_probe || status=1 ;;
    cpu-bench) stage_cpu_bench || status=1 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $status
