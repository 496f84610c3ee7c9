#!/usr/bin/env bash
# gpt with its layers split over tensor-parallel ranks (--tp), checked from
# outside (ctest entry "examples_parallel"). Usage: check_parallel.sh BIN_DIR
# (BIN_DIR holds tandem-run and the examples, e.g. build/bin).
#
# The model: 2 blocks of width 36 with 6 heads (so tp 2 and 3 both take
# whole heads), over the default text's 86 characters (not a multiple of 3:
# tp 3 splits the vocabulary unevenly), with --clip 0.05 so that clipping
# acts on every step.
#  a. 1 x 1 x 1 (pp x dp x tp) is the baseline. tp 2, tp 3, tp 2 x pp 2,
#     tp 2 x dp 2, tp 2 x pp 2 x dp 2 (8 processes), tp 2 x pp 2 with the
#     interleaved schedule, and tp 2 x dp 2 with --zero 1, --zero 2 and
#     --zero 3 (each tp rank's Adam state, or its gradients too, or its
#     whole split, sharded over its replicas) each end on its
#     loss, and their parameters' norm and projection (gpt's "parameters:"
#     line: the whole model's, summed over the tp ranks' slices) are within
#     1e-5 relative of its.
#     With --sequence-parallel (the regions between the split layers on
#     each rank's piece of the sequence, the replicated parameters'
#     partial gradients summed in backward): tp 2, tp 2 x pp 2 x dp 2 and
#     tp 2 x dp 2 --zero 3 end as 1 x 1 x 1 likewise;
#  b. --recompute gives identical final and parameter lines to the same
#     layout without it (1 x 1 x 1, tp 2 x pp 2, tp 2 x dp 2 --zero 3, and
#     tp 2 --sequence-parallel);
#  c. under tandem-run --max-restarts 1, a stage's tp rank killed by
#     SIGKILL mid-run: the job restarts within seconds, naming it, from its
#     newest checkpoint, and ends as the uninterrupted run (a tp peer's
#     collectives failing on a dead rank, naming it, are tests/parallel's);
#  d. resharding: tp 2 x pp 2 x dp 2 stopped at step 6 (each tp rank's
#     stage workers write their slices of the split parameters and of their
#     Adam state under the whole ones' names) resumes as 1 x 1 x 1, as tp 2
#     alone, as tp 3 and under --zero 3 (FSDP); 1 x 1 x 1's step and
#     --zero 3's resume as tp 2 x pp 2 and tp 2 x dp 2 --zero 1; tp 2 x dp 3
#     --zero 3 (whose shards cut a column-split weight inside its block)
#     resumes as 1 x 1 x 1, as tp 3 x dp 2 --zero 3 and as tp 2 x pp 2: each
#     ends on the uninterrupted run's loss and parameters;
#  e. --dropout 0.1 (each block's masks from its layer's generator, whole
#     masks cut by the tp ranks): tp 2, tp 2 x pp 2, tp 3 --recompute and
#     tp 2 x pp 2 --sequence-parallel --recompute end
#     on 1 x 1 x 1's loss and parameters with the same dropout; --zero 3
#     and --zero 2 with --recompute (each FSDP unit's block recomputed) end
#     exactly as without;
#  g. the point of it: under a cap of 1900 MiB of data a process (prlimit
#     --data, which every worker inherits), a gpt of 6 blocks of width 1024
#     (76M parameters; Adam's state, gradients and parameters 1.2 GB) with
#     --recompute fails to train at tp 1 x dp 2 --zero 1, its allocator
#     naming the failed allocation, and trains (and checkpoints) at tp 2 x
#     dp 2 --zero 1;
#  h. bad input exits 2 naming it: heads that --tp does not divide, --tp
#     with --zero 3 and --pp 2, a world that is not pp x dp x tp,
#     --sequence-parallel without --tp or with a --context --tp does not
#     divide, a --dropout that is not a probability.
set -uo pipefail
bin="$(readlink -f "${1:?usage: check_parallel.sh BIN_DIR}")"
here="$(dirname "$(readlink -f "$0")")"
# shellcheck source=check_lib.sh
source "$here/check_lib.sh"

args=(--steps 12 --layers 2 --dim 36 --heads 6 --context 16 --batch 8 --chunks 2 --clip 0.05
  --log-every 6 --sample 0)
params_line() { grep -o 'parameters: norm .*' "$1"; }
# close WHAT BASE_LOG LOG: the final loss and the parameters' two numbers within 1e-5 relative.
close() {
  local want got
  want="$(gpt_final "$2") $(params_line "$2" | awk '{print $3, $5}')"
  got="$(gpt_final "$3") $(params_line "$3" | awk '{print $3, $5}')"
  if ! awk -v a="$want" -v b="$got" 'BEGIN {
      n = split(a, x, " "); m = split(b, y, " "); if (n != 3 || m != 3) exit 1
      for (i = 1; i <= 3; ++i) {
        d = x[i] - y[i]; if (d < 0) d = -d
        s = x[i] < 0 ? -x[i] : x[i]
        if (d > 1e-5 * s + 1e-6) exit 1
      }
    }'; then
    fail "$1: loss, norm, projection '$got', 1 x 1 x 1: '$want'"
  else
    echo "ok: $1 ends as 1 x 1 x 1: $got"
  fi
}
# identical WHAT LOG_A LOG_B: the same final and parameter lines, to the last digit printed.
identical() {
  if [[ -z $(params_line "$2") || "$(final_line "$2") $(params_line "$2")" != "$(final_line "$3") $(params_line "$3")" ]]; then
    fail "$1: '$(final_line "$3") $(params_line "$3")' against '$(final_line "$2") $(params_line "$2")'"
  else
    echo "ok: $1: $(final_line "$3") $(params_line "$3")"
  fi
}

# a. the layouts
rc=$(launch t111.log 1 gpt --pp 1 --dp 1 --tp 1 "${args[@]}" --checkpoint t111.ckpt)
expect_rc "gpt 1 x 1 x 1" "$rc" 0 t111.log
for layout in "1 1 2" "1 1 3" "2 1 2" "1 2 2" "2 2 2" "2 1 2 --schedule interleaved" "1 2 2 --zero 1" \
  "1 2 2 --zero 2" "1 2 2 --zero 3" "1 1 2 --sequence-parallel" "2 2 2 --sequence-parallel" \
  "1 2 2 --zero 3 --sequence-parallel"; do
  set -- $layout
  name="t$1$2$3$(echo "${*:4}" | tr -d ' -')"
  what="gpt $1 x $2 x $3 ${*:4}"
  rc=$(launch "$name.log" $(($1 * $2 * $3)) gpt --pp "$1" --dp "$2" --tp "$3" "${@:4}" "${args[@]}" \
    --checkpoint "$name.ckpt")
  expect_rc "$what" "$rc" 0 "$name.log" && close "$what" t111.log "$name.log"
done

# b. recomputation: bit for bit the same training
rc=$(launch r111.log 1 gpt --pp 1 --dp 1 "${args[@]}" --recompute --checkpoint r111.ckpt)
expect_rc "gpt 1 x 1 x 1 --recompute" "$rc" 0 r111.log && identical "--recompute, 1 x 1 x 1" t111.log r111.log
rc=$(launch r212.log 4 gpt --pp 2 --dp 1 --tp 2 "${args[@]}" --recompute --checkpoint r212.ckpt)
expect_rc "gpt 2 x 1 x 2 --recompute" "$rc" 0 r212.log && identical "--recompute, 2 x 1 x 2" t212.log r212.log
rc=$(launch r122.log 4 gpt --pp 1 --dp 2 --tp 2 --zero 3 "${args[@]}" --recompute --checkpoint r122.ckpt)
expect_rc "gpt 1 x 2 x 2 --zero 3 --recompute" "$rc" 0 r122.log &&
  identical "--recompute, 1 x 2 x 2 --zero 3" t122zero3.log r122.log
rc=$(launch r112s.log 2 gpt --pp 1 --dp 1 --tp 2 --sequence-parallel "${args[@]}" --recompute \
  --checkpoint r112s.ckpt)
expect_rc "gpt 1 x 1 x 2 --sequence-parallel --recompute" "$rc" 0 r112s.log &&
  identical "--recompute, 1 x 1 x 2 --sequence-parallel" t112sequenceparallel.log r112s.log

# c. a tp rank of the second stage (rank 3 of 2 x 1 x 2) killed after step 8 of 80
# (80: the kill lands mid-run however fast the steps go)
long=(--steps 80 --layers 2 --dim 36 --heads 6 --context 16 --batch 8 --chunks 2 --log-every 1 --sample 0
  --checkpoint-every 4)
rc=$(launch k0.log 4 gpt --pp 2 --dp 1 --tp 2 "${long[@]}" --checkpoint k0.ckpt)
expect_rc "gpt 2 x 1 x 2 --steps 80" "$rc" 0 k0.log
tag="tp-check-$$-$RANDOM"
CHECK_TAG="$tag" timeout 120 "$run" --max-restarts 1 --nproc-per-node 4 "$bin/gpt" --pp 2 --dp 1 \
  --tp 2 "${long[@]}" --checkpoint k.ckpt >k.log 2>&1 &
launcher=$!
victim=""
if await k.log "steps 1\.\." && await k.log "step 8/"; then
  victim=$(pids_of "$tag" | sed -n 's/^3://p')
fi
if [[ -z $victim ]]; then
  fail "gpt 2 x 1 x 2: rank 3 not found running"
else
  kill -9 "$victim"
  killed_at=$(date +%s.%N)
  await k.log "restart 1 of 1" 1500
  restarted_at=$(date +%s.%N)
  wait "$launcher"
  rc=$?
  if expect_rc "gpt 2 x 1 x 2, rank 3 killed after step 8, --max-restarts 1" "$rc" 0 k.log; then
    # (tandem-run stops the others at once; a worker that got to fail first names it too)
    grep -q "worker 3 killed by signal 9" k.log || { fail "nobody named rank 3"; sed 's/^/    /' k.log; }
    # (from a checkpoint at or after step 4: the job may run on a few steps
    # before the kill lands)
    from=$(sed -n 's/.*gpt: restart 1: from step \([0-9]*\).*/\1/p' k.log)
    [[ -n $from ]] && ((from >= 4)) ||
      { fail "the restart did not go on from a checkpoint"; sed 's/^/    /' k.log; }
    secs=$(awk -v a="$killed_at" -v b="$restarted_at" 'BEGIN { printf "%.1f", b - a }')
    awk -v s="$secs" 'BEGIN { exit !(s < 10) }' || fail "the restart came $secs s after the kill"
    if [[ "$(final_line k0.log)" != "$(final_line k.log)" ]]; then
      fail "gpt restarted: '$(final_line k.log)', uninterrupted: '$(final_line k0.log)'"
    else
      echo "ok: rank 3 killed: named, restarted after $secs s from step $from, ends as uninterrupted: $(final_line k.log)"
    fi
  fi
fi

# d. resharding, both ways (the steps copied: each run prunes its directory)
rc=$(launch s222.log 8 gpt --pp 2 --dp 2 --tp 2 "${args[@]}" --stop-at 6 --checkpoint s222.ckpt)
expect_rc "gpt 2 x 2 x 2 --stop-at 6" "$rc" 0 s222.log
rc=$(launch s111.log 1 gpt --pp 1 --dp 1 "${args[@]}" --stop-at 6 --checkpoint s111.ckpt)
expect_rc "gpt 1 x 1 x 1 --stop-at 6" "$rc" 0 s111.log
rc=$(launch sz3.log 2 gpt --pp 1 --dp 2 --zero 3 "${args[@]}" --stop-at 6 --checkpoint sz3.ckpt)
expect_rc "gpt 1 x 2 --zero 3 --stop-at 6" "$rc" 0 sz3.log
resumed() {  # WHAT FROM NPROC ARGS...
  local what="$1" from="$2" nproc="$3" name="r$RANDOM"
  shift 3
  cp -r "$from" "$name.ckpt"
  rc=$(launch "$name.log" "$nproc" gpt "$@" "${args[@]}" --resume --checkpoint "$name.ckpt")
  if expect_rc "$what" "$rc" 0 "$name.log"; then
    grep -q "restored where it lives\|resumed from step 6" "$name.log" ||
      fail "$what: no resume said"
    if [[ -n $(params_line "$name.log") ]]; then
      close "$what" t111.log "$name.log"
    else
      near "$what" "$(gpt_final t111.log)" "$(gpt_final "$name.log")"
    fi
  fi
}
resumed "tp 2 x pp 2 x dp 2's step as 1 x 1 x 1" s222.ckpt 1 --pp 1 --dp 1
resumed "tp 2 x pp 2 x dp 2's step as tp 2" s222.ckpt 2 --pp 1 --dp 1 --tp 2
resumed "tp 2 x pp 2 x dp 2's step as tp 3" s222.ckpt 3 --pp 1 --dp 1 --tp 3
resumed "tp 2 x pp 2 x dp 2's step under --zero 3" s222.ckpt 2 --pp 1 --dp 2 --zero 3
resumed "1 x 1 x 1's step as tp 2 x pp 2" s111.ckpt 4 --pp 2 --dp 1 --tp 2
resumed "--zero 3's step as tp 2 x dp 2 --zero 1" sz3.ckpt 4 --pp 1 --dp 2 --tp 2 --zero 1
# (a batch of 6 for 3 replicas: its own baseline)
args6=("${args[@]}")
args6[11]=6
rc=$(launch u111.log 1 gpt --pp 1 --dp 1 "${args6[@]}" --checkpoint u111.ckpt)
expect_rc "gpt 1 x 1 x 1 --batch 6" "$rc" 0 u111.log
rc=$(launch u132.log 6 gpt --pp 1 --dp 3 --tp 2 --zero 3 "${args6[@]}" --stop-at 6 --checkpoint u132.ckpt)
expect_rc "gpt 1 x 3 x 2 --zero 3 --stop-at 6" "$rc" 0 u132.log
grep -aq 'proj.weight#d1:0:[0-9]*@' u132.ckpt/step-*/MANIFEST ||
  fail "tp 2 x dp 3 --zero 3: no part of a column block written"
for layout in "1 --pp 1 --dp 1" "6 --pp 1 --dp 2 --tp 3 --zero 3" "4 --pp 2 --dp 1 --tp 2"; do
  set -- $layout
  n="$1"
  shift
  rm -rf u.ckpt && cp -r u132.ckpt u.ckpt
  rc=$(launch u.log "$n" gpt "$@" "${args6[@]}" --resume --checkpoint u.ckpt)
  expect_rc "tp 2 x dp 3 --zero 3's step as $*" "$rc" 0 u.log &&
    close "tp 2 x dp 3 --zero 3's step as $*" u111.log u.log
done

# e. dropout: the same masks under any tp and pp
rc=$(launch d111.log 1 gpt --pp 1 --dp 1 "${args[@]}" --dropout 0.1 --checkpoint d111.ckpt)
if expect_rc "gpt 1 x 1 x 1 --dropout 0.1" "$rc" 0 d111.log; then
  [[ "$(gpt_final d111.log)" != "$(gpt_final t111.log)" ]] || fail "--dropout 0.1 changed nothing"
  for layout in "1 1 2" "2 1 2" "1 1 3 --recompute" "2 1 2 --sequence-parallel --recompute"; do
    set -- $layout
    name="d$1$2$3$(echo "${*:4}" | tr -d ' -')"
    what="gpt $1 x $2 x $3 --dropout 0.1 ${*:4}"
    rc=$(launch "$name.log" $(($1 * $2 * $3)) gpt --pp "$1" --dp "$2" --tp "$3" "${@:4}" "${args[@]}" \
      --dropout 0.1 --checkpoint "$name.ckpt")
    expect_rc "$what" "$rc" 0 "$name.log" && close "$what" d111.log "$name.log"
  done
fi
for zero in 2 3; do
  rc=$(launch "z$zero.log" 2 gpt --pp 1 --dp 2 --zero "$zero" "${args[@]}" --checkpoint "z$zero.ckpt")
  rc2=$(launch "z${zero}r.log" 2 gpt --pp 1 --dp 2 --zero "$zero" --recompute "${args[@]}" \
    --checkpoint "z${zero}r.ckpt")
  if expect_rc "gpt --zero $zero" "$rc" 0 "z$zero.log" &&
    expect_rc "gpt --zero $zero --recompute" "$rc2" 0 "z${zero}r.log"; then
    if [[ -z $(final_line "z$zero.log") || "$(final_line "z$zero.log")" != "$(final_line "z${zero}r.log")" ]]; then
      fail "--zero $zero --recompute: '$(final_line "z${zero}r.log")', without: '$(final_line "z$zero.log")'"
    else
      echo "ok: --zero $zero --recompute ends as without: $(final_line "z${zero}r.log")"
    fi
  fi
done

# g. a model that fits only when split, under the same cap per process
if command -v prlimit >/dev/null; then
  cap=$((1900 * 1024 * 1024))  # (uncapped, tp 1 peaks at about 2350 MiB, tp 2 at 1600)
  big=(--steps 2 --layers 6 --dim 1024 --heads 16 --context 64 --batch 8 --chunks 1 --log-every 1
    --sample 0 --recompute)
  capped() {  # LOG NPROC ARGS...
    local log="$1" nproc="$2"
    shift 2
    timeout 300 prlimit --data="$cap" -- "$run" --nproc-per-node "$nproc" "$bin/gpt" "$@" >"$log" 2>&1
    echo $?
  }
  rc=$(capped cap1.log 2 --pp 1 --dp 2 --tp 1 --zero 1 "${big[@]}" --checkpoint cap1.ckpt)
  # (out of memory shows as a failed allocation, or as a thread that cannot start: EAGAIN)
  if [[ $rc == 0 ]] || ! grep -Eq "can't allocate memory|Resource temporarily unavailable" cap1.log; then
    fail "tp 1 under the cap: exit $rc, no allocation failure said"; sed 's/^/    /' cap1.log | head -20
  else
    echo "ok: tp 1 x dp 2 --zero 1 under 1900 MiB a process fails: $(grep -Eo "can't allocate memory[^.]*|Resource temporarily unavailable" cap1.log | head -1)"
  fi
  rc=$(capped cap2.log 4 --pp 1 --dp 2 --tp 2 --zero 1 "${big[@]}" --checkpoint cap2.ckpt)
  expect_rc "tp 2 x dp 2 --zero 1 under 1900 MiB a process" "$rc" 0 cap2.log &&
    echo "ok: it trains split: $(final_line cap2.log)"
else
  echo "skipped: the memory cap (no prlimit)"
fi

# h. bad input, each named
bad() {
  local what="$1" nproc="$2" want="$3"
  shift 3
  rc=$(launch bad.log "$nproc" gpt "$@")
  if expect_rc "$what" "$rc" 2 bad.log; then
    grep -q -- "$want" bad.log || { fail "$what: no '$want' said"; sed 's/^/    /' bad.log; }
  fi
}
bad "--tp 4 with 6 heads" 4 "--tp 4 does not divide --heads 6" --pp 1 --dp 1 --tp 4 "${args[@]}"
bad "--tp 2 --zero 3 --pp 2" 4 "--zero 3 trains the whole model on every rank: pass --pp 1" --pp 2 --dp 1 \
  --tp 2 --zero 3 "${args[@]}"
bad "--pp 2 --tp 2 on 2 processes" 2 "needs 4 processes, not 2" --pp 2 --dp 1 --tp 2 "${args[@]}"
bad "--sequence-parallel with --tp 1" 1 "--sequence-parallel splits the sequence over tensor-parallel ranks" \
  --pp 1 --dp 1 "${args[@]}" --sequence-parallel
bad "--sequence-parallel, --context 16 over --tp 3" 3 "--context 16 does not split into 3 equal pieces" \
  --pp 1 --dp 1 --tp 3 "${args[@]}" --sequence-parallel
bad "--dropout 1.5" 1 "--dropout 1.500000 is not a probability in \[0, 1)" --pp 1 --dp 1 "${args[@]}" --dropout 1.5

finish check_parallel
