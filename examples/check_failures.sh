#!/usr/bin/env bash
# The examples failing from outside, as an operator sees it (ctest entry
# "examples_failures"). Usage: check_failures.sh BIN_DIR   (BIN_DIR holds
# tandem-run and the examples, e.g. build/bin).
#
#  a. a worker stalled (SIGSTOP) after a random step, under tandem-run
#     --max-restarts 1 --peer-timeout 3: gpt as 1 x 2, 2 x 1, 2 x 2, 2 x 2
#     --zero 1, 1 x 2 --zero 2 and --zero 3, and char_lm --mode hybrid (DDP
#     + RPC) restart within the timeout and a few seconds, and end on the
#     uninterrupted loss;
#  b. SIGUSR1 to every worker of a running gpt 2 x 2 prints each one's
#     snapshot (the stage workers wait in their graceful shutdown), and the
#     job ends as an undisturbed one;
#  c. each part of gpt 2 x 2's newest checkpoint damaged in turn (its bytes
#     altered on disk while the job is stopped, then a worker killed): the
#     restart under --max-restarts passes over that step, saying which file
#     and why, goes back one step and ends on the uninterrupted loss; so
#     does --resume; --strict-resume refuses, naming the file;
#  d. a NaN in step 5's batch (--nan-at 5): with --on-nonfinite skip every
#     gpt layout (1 x 1, 1 x 2, 2 x 1, 2 x 2, --zero 1, 2, 3) skips that
#     step alike and ends on the same finite loss; with stop each exits 1
#     naming the step; char_lm's three modes likewise.
set -uo pipefail
bin="$(readlink -f "${1:?usage: check_failures.sh BIN_DIR}")"
here="$(dirname "$(readlink -f "$0")")"
# shellcheck source=check_lib.sh
source "$here/check_lib.sh"

# same WHAT LOG BASE_LOG: the final lines are identical
same() {
  if [[ -z $(final_line "$3") || "$(final_line "$2")" != "$(final_line "$3")" ]]; then
    fail "$1: '$(final_line "$2")', uninterrupted: '$(final_line "$3")'"
  else
    echo "ok: $1 ends as uninterrupted: $(final_line "$2")"
  fi
}

gpt_args=(--steps 20 --log-every 1 --sample 0 --checkpoint-every 4)
# The uninterrupted runs.
for layout in "1 1" "1 2" "2 1" "2 2"; do
  set -- $layout
  rc=$(launch "b$1$2.log" $(($1 * $2)) gpt --pp "$1" --dp "$2" "${gpt_args[@]}" --checkpoint "b$1$2.ckpt")
  expect_rc "gpt $1 x $2 uninterrupted" "$rc" 0 "b$1$2.log"
done
base=$(gpt_final b11.log)

# a. A stalled worker. stalled_run LOG NPROC VICTIM AFTER PROGRAM ARGS...:
# VICTIM stopped (SIGSTOP) the moment step AFTER is printed; prints
# tandem-run's exit code, and the seconds from the stop to the restart.
stalled_run() {
  local log="$1" nproc="$2" victim="$3" after="$4" program="$5" tag="stall-$$-$RANDOM"
  shift 5
  CHECK_TAG="$tag" timeout 150 "$run" --max-restarts 1 --peer-timeout 3 --nproc-per-node "$nproc" \
    "$bin/$program" "$@" >"$log" 2>&1 &
  local launcher=$! pid="" t0 t1
  await "$log" "step $after/" || await "$log" "step $after " 1
  pid=$(pids_of "$tag" | sed -n "s/^$victim://p")
  [[ -n $pid ]] && kill -STOP "$pid"
  t0=$(date +%s%N)
  while kill -0 "$launcher" 2>/dev/null && ! grep -q "restart 1 of 1" "$log"; do sleep 0.05; done
  t1=$(date +%s%N)
  wait "$launcher"
  echo "$? $(((t1 - t0) / 1000000000))"
}
# stalled WHAT LOG NPROC PROGRAM ARGS...: a random rank stopped after a
# random step; passes when the job restarted within 13 s and exited 0.
stalled() {
  local what="$1" log="$2" nproc="$3" victim=$((RANDOM % $3)) after=$((2 + RANDOM % 12)) out rc took
  shift 3
  out=$(stalled_run "$log" "$nproc" "$victim" "$after" "$@")
  read -r rc took <<<"$out"
  what="$what, rank $victim stopped after step $after"
  expect_rc "$what" "$rc" 0 "$log" || return 1
  if ! grep -q "restart 1 of 1" "$log"; then
    fail "$what: no restart"; sed 's/^/    /' "$log"; return 1
  fi
  # The peer timeout (3 s), the workers' stop and the new round.
  ((took <= 13)) || { fail "$what: restarted $took s after the stop"; sed 's/^/    /' "$log"; return 1; }
  echo "ok: $what restarted $took s after the stop"
}
for layout in "1 2" "2 1" "2 2"; do
  set -- $layout
  stalled "gpt $1 x $2" "s$1$2.log" $(($1 * $2)) gpt --pp "$1" --dp "$2" "${gpt_args[@]}" --checkpoint "s$1$2.ckpt" &&
    same "gpt $1 x $2, a worker stalled" "s$1$2.log" "b$1$2.log"
done
stalled "gpt 2 x 2 --zero 1" sz1.log 4 gpt "${gpt_args[@]}" --zero 1 --checkpoint sz1.ckpt &&
  near "gpt 2 x 2 --zero 1, a worker stalled" "$(gpt_final b22.log)" "$(gpt_final sz1.log)"
for z in 2 3; do
  stalled "gpt 1 x 2 --zero $z" "sz$z.log" 2 gpt --pp 1 --dp 2 "${gpt_args[@]}" --zero "$z" --checkpoint "sz$z.ckpt" &&
    near "gpt 1 x 2 --zero $z, a worker stalled" "$base" "$(gpt_final "sz$z.log")"
done
# DDP + RPC: char_lm's two DDP trainers share the parameter server's modules.
if stalled "char_lm --mode hybrid (2 trainers, 1 server)" sh.log 3 char_lm --mode hybrid --steps 40 --log-every 1 --checkpoint sh.ckpt; then
  grep -q "trainers' LSTMs identical" sh.log || fail "char_lm hybrid, stalled and restarted: trainers differ"
fi

# b. SIGUSR1 to every worker of a running job: each prints its snapshot;
# the job goes on undisturbed.
tag="usr1-$$-$RANDOM"
CHECK_TAG="$tag" timeout 120 "$run" --nproc-per-node 4 "$bin/gpt" "${gpt_args[@]}" --checkpoint u.ckpt >u.log 2>&1 &
launcher=$!
await u.log "step 5/"
for entry in $(pids_of "$tag"); do kill -USR1 "${entry#*:}"; done
wait "$launcher"
if expect_rc "gpt 2 x 2, SIGUSR1 to every worker" "$?" 0 u.log; then
  for r in 0 1 2 3; do
    grep -q "^\[$r\]: tandem debug info: worker$r " u.log || fail "SIGUSR1: worker $r printed no snapshot"
  done
  same "gpt 2 x 2 asked for snapshots" u.log b22.log
fi

# c. A damaged newest checkpoint. damaged_run LOG PART: gpt 2 x 2 under
# --max-restarts 1, saving in the step (no save in flight between steps),
# stopped whole once step 13 is printed, the given part of its newest step
# altered on disk, then rank 3 killed and the others continued: the restart
# must go back past the damaged step.
damage() {  # damage FILE: alters 16 bytes in its middle
  local size
  size=$(stat -c %s "$1")
  printf 'damaged-on-disk!' | dd of="$1" bs=1 seek=$((size / 2)) conv=notrunc status=none
}
damaged_run() {
  local log="$1" part="$2" tag="damage-$$-$RANDOM" entry newest
  CHECK_TAG="$tag" timeout 150 "$run" --max-restarts 1 --nproc-per-node 4 "$bin/gpt" "${gpt_args[@]}" \
    --checkpoint-sync --checkpoint "$log.ckpt" >"$log" 2>&1 &
  local launcher=$! pids=""
  await "$log" "steps 1\.\."
  while [[ $(wc -w <<<"$pids") -lt 4 ]] && kill -0 "$launcher" 2>/dev/null; do pids=$(pids_of "$tag"); done
  await "$log" "step 13/"
  for entry in $pids; do kill -STOP "${entry#*:}"; done
  sleep 0.2
  newest=$(ls -d "$log.ckpt"/step-*/MANIFEST | tail -n1)
  newest=${newest%/MANIFEST}
  damage "$newest/part-$part.bin"
  echo "$newest" >"$log.damaged"
  for entry in $pids; do
    if [[ ${entry%%:*} == 3 ]]; then kill -KILL "${entry#*:}"; else kill -CONT "${entry#*:}"; fi
  done
  wait "$launcher"
  echo $?
}
for part in 0 1 2 3 4; do
  rc=$(damaged_run "d$part.log" "$part")
  what="gpt 2 x 2, part-$part.bin of its newest step damaged, restarted"
  if expect_rc "$what" "$rc" 0 "d$part.log"; then
    step=$(sed 's/.*step-0*//' "d$part.log.damaged")
    if ! grep -q "gpt: passed over a damaged checkpoint: .*step-0*$step: .*part-$part.bin: its checksum does not match the manifest's" "d$part.log" ||
      ! grep -q "gpt: restart 1: from step $((step - 4))" "d$part.log"; then
      fail "$what: no fallback from step $step said"; sed 's/^/    /' "d$part.log"
    else
      same "$what from step $((step - 4))" "d$part.log" b22.log
    fi
  fi
done
# --resume does the same; --strict-resume refuses, naming the file.
rc=$(launch dr0.log 4 gpt "${gpt_args[@]}" --stop-at 12 --checkpoint dr.ckpt)
expect_rc "gpt 2 x 2 --stop-at 12" "$rc" 0 dr0.log
cp -r dr.ckpt drs.ckpt
damage dr.ckpt/step-0000000012/part-2.bin
damage drs.ckpt/step-0000000012/part-0.bin
rc=$(launch dr1.log 4 gpt "${gpt_args[@]}" --resume --checkpoint dr.ckpt)
if expect_rc "gpt --resume past a damaged step" "$rc" 0 dr1.log; then
  grep -q "passed over a damaged checkpoint: .*step-0000000012: .*part-2.bin" dr1.log ||
    fail "gpt --resume: the damaged step was not named"
  same "gpt --resume from step 8 past a damaged step 12" dr1.log b22.log
fi
rc=$(launch dr2.log 4 gpt "${gpt_args[@]}" --resume --strict-resume --checkpoint drs.ckpt)
if expect_rc "gpt --resume --strict-resume on a damaged step" "$rc" 2 dr2.log; then
  grep -q "the newest checkpoint, step 12, is damaged: .*part-0.bin: its checksum does not match" dr2.log ||
    { fail "gpt --strict-resume: the file was not named"; sed 's/^/    /' dr2.log; }
fi

# d. A NaN in step 5's batch.
nan_args=("${gpt_args[@]}" --nan-at 5)
rc=$(launch n11.log 1 gpt --pp 1 --dp 1 "${nan_args[@]}" --on-nonfinite skip --checkpoint n11.ckpt)
if expect_rc "gpt 1 x 1 --nan-at 5 --on-nonfinite skip" "$rc" 0 n11.log; then
  nan_base=$(gpt_final n11.log)
  grep -q "1 step(s) skipped for a loss or gradient norm that was not finite: 5" n11.log ||
    fail "gpt 1 x 1: no skipped step reported"
  awk -v l="$nan_base" 'BEGIN { exit !(l + 0 == l && l < 100) }' || fail "gpt 1 x 1 skipping: final loss '$nan_base'"
fi
nonfinite() {  # nonfinite NAME NPROC ARGS...
  local name="$1" n="$2" rc
  shift 2
  rc=$(launch nf.log "$n" gpt "$@" "${nan_args[@]}" --on-nonfinite skip --checkpoint nf.ckpt)
  if expect_rc "gpt $name --nan-at 5 --on-nonfinite skip" "$rc" 0 nf.log; then
    grep -q "1 step(s) skipped for a loss or gradient norm that was not finite: 5" nf.log ||
      fail "gpt $name: no skipped step reported"
    near "gpt $name skipping step 5" "$nan_base" "$(gpt_final nf.log)"
  fi
  rc=$(launch nf.log "$n" gpt "$@" "${nan_args[@]}" --on-nonfinite stop --checkpoint nf2.ckpt)
  if expect_rc "gpt $name --nan-at 5 --on-nonfinite stop" "$rc" 1 nf.log; then
    grep -q "step 5: the loss .*not finite\|step 5: the loss is nan\|step 5: the loss (nan)" nf.log ||
      { fail "gpt $name stopped: the step was not named"; sed 's/^/    /' nf.log; }
  fi
}
nonfinite "1 x 1" 1 --pp 1 --dp 1
nonfinite "1 x 2" 2 --pp 1 --dp 2
nonfinite "2 x 1" 2 --pp 2 --dp 1
nonfinite "2 x 2" 4 --pp 2 --dp 2
nonfinite "2 x 2 --zero 1" 4 --zero 1
nonfinite "1 x 2 --zero 2" 2 --pp 1 --dp 2 --zero 2
nonfinite "1 x 2 --zero 3" 2 --pp 1 --dp 2 --zero 3
for mode in single hybrid pipeline; do
  n=2
  [[ $mode == hybrid ]] && n=3
  rc=$(launch c.log "$n" char_lm --mode "$mode" --steps 20 --log-every 5 --nan-at 5 --on-nonfinite skip --checkpoint "c$mode.ckpt")
  if expect_rc "char_lm --mode $mode --nan-at 5 --on-nonfinite skip" "$rc" 0 c.log; then
    grep -q "1 step(s) skipped for a loss or gradient norm that was not finite: 5" c.log ||
      fail "char_lm $mode: no skipped step reported"
    grep -q "final step 20 loss [0-9]" c.log || fail "char_lm $mode skipping: the final loss is not a number"
  fi
  rc=$(launch c.log "$n" char_lm --mode "$mode" --steps 20 --log-every 5 --nan-at 5 --checkpoint "c$mode-stop.ckpt")
  if expect_rc "char_lm --mode $mode --nan-at 5 (stop, the default)" "$rc" 1 c.log; then
    grep -q "step 5: the loss" c.log || { fail "char_lm $mode stopped: the step was not named"; sed 's/^/    /' c.log; }
  fi
done

finish check_failures
