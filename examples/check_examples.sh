#!/usr/bin/env bash
# Runs the example programs for real, briefly, under tandem-run and alone (ctest entry
# "examples"). Usage: check_examples.sh BIN_DIR   (BIN_DIR holds tandem-run
# and the examples, e.g. build/bin).
#
#  a. char_lm --steps 60: exits 0, its last mean loss is below its first
#     (step 1's) and --losses wrote them as CSV, the final loss line and a sample line are printed; the same
#     with --mode hybrid on 3 processes, whose trainers' LSTMs end identical;
#     --mode pipeline (by 1F1B and by zero-bubble) ends on a's final loss
#     (within 1e-3) and prints a sample;
#     started alone (it spawns its workers, examples/launch.h) it ends on a's
#     final loss, and an unknown flag exits 2 naming it;
#  b. char_lm --steps 30 then --steps 60 --resume prints the same final loss
#     (%.6f) and the same sample as the uninterrupted run of a; under
#     --max-restarts 1 with its parameter server SIGKILLed after step 20, it
#     restarts from its newest checkpoint and ends as a does; an old
#     checkpoint file where the directory goes is refused;
#  c. model_parallel_mlp --steps 20 exits 0 and reports agreement with the
#     local run, under tandem-run and started alone (it spawns its workers);
#  d. parameter_server on 3 processes and on 2 exits 0, every trainer reports;
#     with --ddp (the trainers' heads one DDP model) on 3, the heads end identical;
#     hybrid_ddp_rpc on 4 (master, parameter server, two DDP trainers) exits 0,
#     both trainers report to the master, their DDP layers end identical and
#     trainer0's loss falls; rpc_demo exits 0;
#  e. bad input exits 2 with a one-line reason, without hanging: a missing
#     --corpus, --resume without a checkpoint, an unknown flag, a bad --mode,
#     hybrid on 2 processes, hybrid with --resume, 3 processes without hybrid,
#     pipeline with --resume, --schedule without --mode pipeline;
#  f. ddp_mlp on 2 processes, and as two one-process "nodes" (two tandem-run
#     --nnodes 2), exits 0 with identical replicas and a falling loss; a bad
#     flag exits 2, as does --backend mpi, and --backend nccl where LibTorch has no CUDA;
#  g. gpt --steps 20 as 1 x 1, 1 x 2, 2 x 1 and 2 x 2 (pp x dp), and 2 x 2 by
#     gpipe, zero-bubble and interleaved, ends on the same loss (within 1e-4);
#     its loss falls, --losses writes the CSV, a sample is printed; stopped at
#     10 and resumed to 20 it ends exactly as uninterrupted (2 x 2 -> 2 x 2),
#     and within 1e-4 when resumed on another --dp (2 x 2 -> 2 x 1), another
#     --pp (2 x 2 -> 1 x 2) or interleaved (4 stages on 2 workers); started
#     alone it spawns its workers; with --zero 1 (each stage's Adam state
#     sharded over its replicas), stopped at 10 and resumed without it, it
#     ends as the unsharded run; 1 x 2 with --zero 2 and --zero 3 end as 1 x 1;
#     --zero 2 stopped at 10 (each rank writes its part) resumes on 2 ranks
#     and on 1 to the 1 x 1 loss, and by the pipeline (2 x 2), whose own
#     step (5 parts: each stage worker's layers, each optimizer owner's
#     Adam state, rank 0's) resumes under --zero 2; --zero 3 stopped at 10
#     (each rank its shards' slices of every parameter and its Adam state)
#     resumes on 2 ranks exactly, and on 1, as the pipeline and under
#     --zero 2 to the 1 x 1 loss, and the pipeline's step under --zero 3;
#     under tandem-run --max-restarts 3, a random worker killed by SIGKILL
#     after a random step, it restarts from its newest checkpoint and ends
#     exactly as uninterrupted (2 x 2), and as 1 x 1 does under --zero 3
#     (1 x 4); on two elastic nodes (--nnodes 1:2) whose
#     second is lost for good, it goes on as one node, resharded (2 x 2 ->
#     2 x 1), and ends within 1e-4 of the uninterrupted loss; a fresh run
#     into an older run's checkpoint directory removes them first;
#     a layout that is not the world, heads that do not divide the width,
#     a resume past --steps, --zero 3 with --pp 2, and gpt and char_lm
#     each into the other's checkpoints exit 2, named.
set -uo pipefail
bin="$(readlink -f "${1:?usage: check_examples.sh BIN_DIR}")"
here="$(dirname "$(readlink -f "$0")")"
# shellcheck source=check_lib.sh
source "$here/check_lib.sh"

# fell WHAT FIRST LAST: passes when the loss went down from FIRST to LAST.
fell() {
  if [[ -z $2 || -z $3 ]] || ! awk -v f="$2" -v l="$3" 'BEGIN { exit !(l < f) }'; then
    fail "$1: the loss did not fall (first '$2', last '$3')"
  else
    echo "ok: $1 loss $2 -> $3"
  fi
}

# The loss of a progress line "step N/M  loss X ...", by position (first, last).
losses() { sed -n 's/.*step [0-9]*\/[0-9]*  loss \([0-9.]*\) .*/\1/p' "$1"; }
sample_line() { grep -o 'sample: .*' "$1"; }

# a. a short training run
rc=$(launch a.log 2 char_lm --steps 60 --log-every 20 --checkpoint a.ckpt --losses a.csv)
if expect_rc "char_lm --steps 60" "$rc" 0 a.log; then
  fell char_lm "$(losses a.log | head -n1)" "$(losses a.log | tail -n1)"
  # --losses: the same progress lines as CSV (steps 1, 20, 40, 60), for ./dev plot
  [[ $(head -n1 a.csv) == "step,loss,tokens_per_s,elapsed_s" && $(wc -l <a.csv) -eq 5 &&
     $(tail -n1 a.csv | cut -d, -f1) == 60 ]] || { fail "char_lm --losses wrote no CSV curve"; cat a.csv; }
  [[ -n $(final_line a.log) ]] || fail "char_lm printed no final loss line"
  [[ $(sample_line a.log) == "sample: "?* ]] || fail "char_lm printed no sample"
  [[ -f a.ckpt/step-0000000060/MANIFEST ]] || fail "char_lm wrote no checkpoint"
fi

# a''. started alone (no tandem-run), it spawns its two workers itself
# (examples/launch.h) and ends as a did; a bad flag still exits 2
timeout 120 "$bin/char_lm" --steps 60 --log-every 20 --checkpoint a0.ckpt >a0.log 2>&1
rc=$?
if expect_rc "char_lm alone (spawning its workers)" "$rc" 0 a0.log; then
  [[ -n $(final_line a.log) && "$(final_line a.log)" == "$(final_line a0.log)" ]] ||
    fail "char_lm alone: '$(final_line a0.log)', under tandem-run: '$(final_line a.log)'"
fi
timeout 120 "$bin/char_lm" --bogus >a0bad.log 2>&1
rc=$?
if expect_rc "char_lm alone with an unknown flag" "$rc" 2 a0bad.log; then
  grep -q "unknown flag '--bogus'" a0bad.log || fail "char_lm alone did not name the bad flag"
fi

# b. interrupted at 30, resumed to 60: the same numbers as a
rc=$(launch b1.log 2 char_lm --steps 30 --checkpoint b.ckpt)
expect_rc "char_lm --steps 30" "$rc" 0 b1.log
rc=$(launch b2.log 2 char_lm --steps 60 --resume --checkpoint b.ckpt)
if expect_rc "char_lm --steps 60 --resume" "$rc" 0 b2.log; then
  if [[ -z $(final_line a.log) || "$(final_line a.log)" != "$(final_line b2.log)" ]]; then
    fail "resumed run: '$(final_line b2.log)', uninterrupted: '$(final_line a.log)'"
  else
    echo "ok: resumed run ends as the uninterrupted one: $(final_line b2.log)"
  fi
  [[ "$(sample_line a.log)" == "$(sample_line b2.log)" ]] ||
    fail "resumed run sampled another text than the uninterrupted one"
fi

# b'. under tandem-run --max-restarts 1, the parameter server (rank 1)
# killed by SIGKILL after step 20: the job starts again from its newest
# checkpoint (each piece loaded where it lives) and ends as a does.
tag="char-check-$$"
CHAR_CHECK_TAG="$tag" timeout 180 "$run" --max-restarts 1 --nproc-per-node 2 "$bin/char_lm" --steps 60 \
  --log-every 10 --checkpoint-every 10 --checkpoint "$tmp/ak.ckpt" >ak.log 2>&1 &
launcher=$!
for ((i = 0; i < 6000; ++i)); do
  grep -q "step 20/" ak.log && break
  sleep 0.02
done
for p in /proc/[0-9]*; do
  env=$({ tr '\0' '\n' <"$p/environ"; } 2>/dev/null) || continue
  if grep -qx "CHAR_CHECK_TAG=$tag" <<<"$env" && grep -qx "RANK=1" <<<"$env" &&
    grep -qx "TANDEM_RESTART_COUNT=0" <<<"$env"; then
    kill -9 "${p#/proc/}" 2>/dev/null
  fi
done
wait "$launcher"
if expect_rc "char_lm, its parameter server killed after step 20, --max-restarts 1" "$?" 0 ak.log; then
  if ! grep -q "worker 1 killed by signal 9" ak.log || ! grep -q "resuming, steps" ak.log; then
    fail "char_lm killed: no restart from a checkpoint"; sed 's/^/    /' ak.log
  elif [[ "$(final_line a.log)" != "$(final_line ak.log)" ]]; then
    fail "char_lm restarted: '$(final_line ak.log)', uninterrupted: '$(final_line a.log)'"
  else
    echo "ok: char_lm (its parameter server killed) restarted and ends as uninterrupted: $(final_line ak.log)"
  fi
fi

# a'. --mode hybrid: two DDP trainers sharing the parameter server
rc=$(launch ah.log 3 char_lm --mode hybrid --steps 60 --log-every 20)
if expect_rc "char_lm --mode hybrid --steps 60 on 3 processes" "$rc" 0 ah.log; then
  fell "char_lm --mode hybrid" "$(losses ah.log | head -n1)" "$(losses ah.log | tail -n1)"
  grep -q "trainers' LSTMs identical" ah.log || fail "char_lm --mode hybrid: the LSTMs differ or were not compared"
  [[ $(sample_line ah.log) == "sample: "?* ]] || fail "char_lm --mode hybrid printed no sample"
fi

# a''. --mode pipeline: the same model as two pipeline stages; the same
# parameters and batches as a, so the same losses (to float rounding), by
# 1F1B and by zero-bubble (whose backward is split in two passes)
for schedule in 1f1b zero-bubble; do
  rc=$(launch ap.log 2 char_lm --mode pipeline --schedule $schedule --steps 60 --log-every 20)
  if expect_rc "char_lm --mode pipeline --schedule $schedule --steps 60" "$rc" 0 ap.log; then
    single=$(final_line a.log | awk '{print $NF}')
    piped=$(final_line ap.log | awk '{print $NF}')
    if [[ -z $single || -z $piped ]] ||
        ! awk -v a="$single" -v b="$piped" 'BEGIN { d = a - b; exit !(d < 1e-3 && d > -1e-3) }'; then
      fail "char_lm --mode pipeline ($schedule) ends at loss '$piped', single mode at '$single'"
    else
      echo "ok: char_lm --mode pipeline ($schedule) ends as single mode does: loss $piped ($single)"
    fi
    [[ $(sample_line ap.log) == "sample: "?* ]] || fail "char_lm --mode pipeline printed no sample"
  fi
done

# c. model parallelism against the local twin
rc=$(launch c.log 2 model_parallel_mlp --steps 20)
if expect_rc "model_parallel_mlp --steps 20" "$rc" 0 c.log; then
  grep -q 'final parameters agree with' c.log || { fail "model_parallel_mlp reported no agreement"; cat c.log; }
fi
# started alone, it spawns its two workers itself (tandem::spawn)
timeout 120 "$bin/model_parallel_mlp" --steps 20 >c2.log 2>&1
rc=$?
if expect_rc "model_parallel_mlp alone (spawning its workers)" "$rc" 0 c2.log; then
  grep -q '^\[0\]: final parameters agree with' c2.log ||
    { fail "model_parallel_mlp alone reported no agreement"; cat c2.log; }
fi

# d. a parameter server and two trainers, then one
for n in 3 2; do
  rc=$(launch "d$n.log" "$n" parameter_server --steps 40)
  if expect_rc "parameter_server on $n processes" "$rc" 0 "d$n.log"; then
    for ((r = 1; r < n; r++)); do
      grep -q "trainer $r: step 40/40" "d$n.log" || fail "parameter_server: trainer $r did not finish"
    done
  fi
done

# d'. the same with one DistributedDataParallel head for the trainers (hybrid)
rc=$(launch dd.log 3 parameter_server --steps 40 --ddp)
if expect_rc "parameter_server --ddp on 3 processes" "$rc" 0 dd.log; then
  for r in 1 2; do grep -q "trainer $r: step 40/40" dd.log || fail "parameter_server --ddp: trainer $r did not finish"; done
  grep -q "trainers' heads identical" dd.log || fail "parameter_server --ddp: the heads differ or were not compared"
fi

# d''. PyTorch's DDP + RPC tutorial: a master, a parameter server, two DDP trainers
rc=$(launch h.log 4 hybrid_ddp_rpc --epochs 30)
if expect_rc "hybrid_ddp_rpc on 4 processes" "$rc" 0 h.log; then
  for t in 0 1; do grep -q "master: trainer$t done" h.log || fail "hybrid_ddp_rpc: trainer$t did not report to the master"; done
  grep -q "trainers' DDP layers identical" h.log || fail "hybrid_ddp_rpc: the DDP layers differ or were not compared"
  fell "hybrid_ddp_rpc trainer0" "$(sed -n 's/.*trainer0: epoch 1\/30  loss \([0-9.]*\)/\1/p' h.log)" \
    "$(sed -n 's/.*trainer0: epoch 30\/30  loss \([0-9.]*\)/\1/p' h.log)"
fi

rc=$(launch rpc_demo.log 2 rpc_demo)
expect_rc "rpc_demo" "$rc" 0 rpc_demo.log

# e. bad input: exit 2, one clear line, nobody left waiting
check_bad() {  # check_bad NAME PATTERN ARGS...
  local name="$1" pattern="$2"
  shift 2
  local rc
  rc=$(launch e.log 2 char_lm "$@")
  if expect_rc "char_lm $*" "$rc" 2 e.log; then
    grep -q -- "$pattern" e.log || { fail "char_lm $*: no message matching '$pattern'"; cat e.log; }
  fi
}
check_bad missing "corpus file '$tmp/missing.txt' does not exist" --corpus "$tmp/missing.txt"
check_bad resume "--resume: no checkpoint in" --resume --checkpoint "$tmp/none.ckpt"
touch "$tmp/old.ckpt"
check_bad old-file "is a file (an older char_lm's checkpoint?)" --checkpoint "$tmp/old.ckpt"
check_bad flag "unknown flag '--bogus'" --bogus
check_bad mode "bad value 'bogus' for --mode" --mode bogus
check_bad hybrid2 "needs 3 or more processes" --mode hybrid
rc=$(launch e.log 3 char_lm --mode hybrid --resume)
expect_rc "char_lm --mode hybrid --resume" "$rc" 2 e.log && { grep -q "resume is for --mode single" e.log || fail "char_lm --mode hybrid --resume: no message"; }
rc=$(launch e.log 3 char_lm)
expect_rc "char_lm on 3 processes without --mode hybrid" "$rc" 2 e.log && { grep -q "pass --mode hybrid" e.log || fail "char_lm on 3: no message"; }
check_bad pipeline-resume "a pipeline run writes no checkpoint" --mode pipeline --resume
check_bad schedule-single "schedule is for --mode pipeline" --schedule gpipe

# f. data parallelism
ddp_ok() {  # ddp_ok WHAT LOG: the replicas agree and the loss fell
  local line
  line=$(grep -o 'final loss [0-9.]* (first step [0-9.]*); replicas [a-zA-Z]*' "$2")
  if [[ $line != *"replicas identical" ]]; then
    fail "$1: no 'replicas identical' line"
    sed 's/^/    /' "$2"
  elif ! awk -v l="$(echo "$line" | awk '{print $3}')" -v f="$(echo "$line" | awk '{print $6}' | tr -d ')')" \
      'BEGIN { exit !(l < f) }'; then
    fail "$1: the loss did not fall ($line)"
  else
    echo "ok: $1: $line"
  fi
}
rc=$(launch f.log 2 ddp_mlp --epochs 2 --samples 2048)
expect_rc "ddp_mlp on 2 processes" "$rc" 0 f.log && ddp_ok "ddp_mlp" f.log
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for node in 0 1; do
  timeout 120 "$run" --nnodes 2 --node-rank "$node" --master-addr 127.0.0.1 --master-port "$port" \
    --nproc-per-node 1 "$bin/ddp_mlp" --epochs 2 --samples 2048 >"f$node.log" 2>&1 &
done
wait %1; rc0=$?
wait %2; rc1=$?
expect_rc "ddp_mlp node 0 of 2" "$rc0" 0 f0.log && ddp_ok "ddp_mlp on two nodes" f0.log
expect_rc "ddp_mlp node 1 of 2" "$rc1" 0 f1.log
rc=$(launch f.log 2 ddp_mlp --bogus)
expect_rc "ddp_mlp --bogus" "$rc" 2 f.log && { grep -q "unknown flag '--bogus'" f.log || fail "ddp_mlp --bogus: no message"; }
rc=$(launch f.log 2 ddp_mlp --backend mpi)
expect_rc "ddp_mlp --backend mpi" "$rc" 2 f.log &&
  { grep -q "takes gloo or nccl, not 'mpi'" f.log || fail "ddp_mlp --backend mpi: no message"; }
if grep -q "^TANDEM_CUDA_BUILD:INTERNAL=OFF" "$bin/../CMakeCache.txt" 2>/dev/null; then
  # Without CUDA, nccl is refused by every rank alike, by name (GPU machines train with it).
  rc=$(launch f.log 2 ddp_mlp --backend nccl)
  expect_rc "ddp_mlp --backend nccl without CUDA" "$rc" 2 f.log &&
    { grep -q "backend 'nccl' needs a LibTorch built with CUDA" f.log || fail "ddp_mlp --backend nccl: no message"; }
fi

# g. the transformer, pipelined x data-parallel (near: within 1e-4 of 1 x 1's loss)
gpt_args=(--steps 20 --log-every 10 --sample 0)
rc=$(launch g11.log 1 gpt --pp 1 --dp 1 "${gpt_args[@]}" --checkpoint g11.ckpt)
if expect_rc "gpt 1 x 1 --steps 20" "$rc" 0 g11.log; then
  base=$(gpt_final g11.log)
  for layout in "1 2" "2 1" "2 2"; do
    set -- $layout
    rc=$(launch "g$1$2.log" $(($1 * $2)) gpt --pp "$1" --dp "$2" "${gpt_args[@]}" --checkpoint "g$1$2.ckpt")
    expect_rc "gpt $1 x $2" "$rc" 0 "g$1$2.log" && near "gpt $1 x $2" "$base" "$(gpt_final "g$1$2.log")"
  done
  for schedule in gpipe zero-bubble interleaved; do
    rc=$(launch "gs.log" 4 gpt --schedule "$schedule" "${gpt_args[@]}" --checkpoint gs.ckpt)
    expect_rc "gpt 2 x 2 --schedule $schedule" "$rc" 0 gs.log && near "gpt 2 x 2 ($schedule)" "$base" "$(gpt_final gs.log)"
  done
fi
rc=$(launch g.log 4 gpt --steps 40 --log-every 10 --checkpoint g.ckpt --losses g.csv)
if expect_rc "gpt 2 x 2 --steps 40" "$rc" 0 g.log; then
  fell gpt "$(losses g.log | head -n1)" "$(losses g.log | tail -n1)"
  [[ $(head -n1 g.csv) == "step,loss,tokens_per_s,elapsed_s" && $(tail -n1 g.csv | cut -d, -f1) == 40 ]] ||
    { fail "gpt --losses wrote no CSV curve"; cat g.csv; }
  [[ $(sample_line g.log) == "sample: "?* ]] || fail "gpt printed no sample"
fi
rc=$(launch gr1.log 4 gpt "${gpt_args[@]}" --stop-at 10 --checkpoint gr.ckpt)
expect_rc "gpt 2 x 2 --stop-at 10" "$rc" 0 gr1.log
for c in gr2 gr4 gr5 gr6 gr7; do cp -r gr.ckpt "$c.ckpt"; done
# Each piece written where it lives: rank 0's part, each stage worker's
# layers, each optimizer owner's Adam state.
[[ $(ls gr.ckpt/step-0000000010/part-*.bin | wc -l) == 5 ]] ||
  fail "gpt 2 x 2: not 5 parts in its step ($(ls gr.ckpt/step-0000000010))"
rc=$(launch gr2.log 4 gpt "${gpt_args[@]}" --resume --checkpoint gr.ckpt)
if expect_rc "gpt 2 x 2 --resume" "$rc" 0 gr2.log; then
  if [[ -z $(final_line g22.log) || "$(final_line g22.log)" != "$(final_line gr2.log)" ]]; then
    fail "gpt resumed: '$(final_line gr2.log)', uninterrupted: '$(final_line g22.log)'"
  else
    echo "ok: gpt resumed ends as the uninterrupted run: $(final_line gr2.log)"
  fi
fi
rc=$(launch gr3.log 2 gpt --dp 1 "${gpt_args[@]}" --resume --checkpoint gr2.ckpt)
expect_rc "gpt 2 x 2 resumed as 2 x 1" "$rc" 0 gr3.log && near "gpt resumed on --dp 1" "$(gpt_final g22.log)" "$(gpt_final gr3.log)"
# Another pipeline: the layers and their Adam state loaded by name where they are now.
rc=$(launch gr4.log 2 gpt --pp 1 --dp 2 "${gpt_args[@]}" --resume --checkpoint gr4.ckpt)
if expect_rc "gpt 2 x 2 resumed as 1 x 2" "$rc" 0 gr4.log; then
  grep -q "step 10 restored where it lives: 1 stages' layers and their Adam state loaded by name (saved in 5 parts, 2 stages)" gr4.log ||
    fail "gpt resumed as 1 x 2: no loading by name said"
  near "gpt resumed on --pp 1" "$(gpt_final g22.log)" "$(gpt_final gr4.log)"
fi
rc=$(launch gr5.log 4 gpt --schedule interleaved "${gpt_args[@]}" --resume --checkpoint gr5.ckpt)
expect_rc "gpt 2 x 2 resumed interleaved (4 stages on 2 workers)" "$rc" 0 gr5.log &&
  near "gpt resumed interleaved" "$(gpt_final g22.log)" "$(gpt_final gr5.log)"
# ZeRO stage 1 inside the pipeline: the same losses, and its checkpoint
# resumes unsharded.
rc=$(launch gz.log 4 gpt "${gpt_args[@]}" --zero 1 --stop-at 10 --checkpoint gz.ckpt)
expect_rc "gpt 2 x 2 --zero 1 --stop-at 10" "$rc" 0 gz.log
rc=$(launch gz2.log 4 gpt "${gpt_args[@]}" --resume --checkpoint gz.ckpt)
expect_rc "gpt 2 x 2 --zero 1 checkpoint resumed unsharded" "$rc" 0 gz2.log &&
  near "gpt --zero 1, resumed without" "$(gpt_final g22.log)" "$(gpt_final gz2.log)"
# ZeRO stages 2 and 3 on the whole model: the same losses as 1 x 1.
for z in 2 3; do
  rc=$(launch "gz$z.log" 2 gpt --pp 1 --dp 2 "${gpt_args[@]}" --zero "$z" --checkpoint "gz$z.ckpt")
  expect_rc "gpt 1 x 2 --zero $z" "$rc" 0 "gz$z.log" && near "gpt 1 x 2 --zero $z" "$base" "$(gpt_final "gz$z.log")"
done
# Restarts: under tandem-run --max-restarts 3, a random worker killed by
# SIGKILL after a random step; the job starts again from its newest
# checkpoint and ends exactly as the uninterrupted run.
# killed_run LOG RANK STEP ARGS...: prints tandem-run's exit code.
killed_run() {
  local log="$1" victim="$2" after="$3" tag="gpt-check-$$-$RANDOM"
  shift 3
  CHECK_TAG="$tag" timeout 120 "$run" --max-restarts 3 --nproc-per-node 4 "$bin/gpt" "$@" \
    >"$log" 2>&1 &
  local launcher=$! i pid=""
  # The victim found first (once the job has started), killed the moment its step is printed.
  for ((i = 0; i < 1200; ++i)); do
    grep -q "steps 1\.\." "$log" && break
    sleep 0.05
  done
  pid=$(pids_of "$tag" | sed -n "s/^$victim://p")
  for ((i = 0; i < 2400; ++i)); do
    grep -q "step $after/" "$log" && break
    sleep 0.02
  done
  [[ -n $pid ]] && kill -9 "$pid" 2>/dev/null
  wait "$launcher"
  echo $?
}
victim=$((RANDOM % 4))
after=$((2 + RANDOM % 14))
rc=$(killed_run gk.log "$victim" "$after" "${gpt_args[@]}" --log-every 1 --checkpoint-every 4 --checkpoint gk.ckpt)
if expect_rc "gpt 2 x 2, rank $victim killed after step $after, --max-restarts 3" "$rc" 0 gk.log; then
  from=$(sed -n 's/.*gpt: restart 1: from step \([0-9]*\).*/\1/p' gk.log)
  # (killed before its first checkpoint was committed: from the beginning)
  grep -q "gpt: restart 1: no checkpoint yet, from the beginning" gk.log && from=0
  if ! grep -q "worker $victim killed by signal 9; stopping the others" gk.log || [[ -z $from ]]; then
    fail "gpt killed: no restart from a checkpoint"; sed 's/^/    /' gk.log
  elif [[ "$(final_line g22.log)" != "$(final_line gk.log)" ]]; then
    fail "gpt restarted: '$(final_line gk.log)', uninterrupted: '$(final_line g22.log)'"
  else
    # At most two intervals lost: the save in flight when it was killed, and the steps since.
    ((from >= after - 8)) || fail "gpt restarted from step $from, killed after $after"
    echo "ok: gpt (rank $victim killed after step $after) restarted from step $from and ends as uninterrupted"
  fi
fi
# The same under --zero 3 on 4 ranks: each restarted rank loads the slices
# its shards overlap.
victim=$((RANDOM % 4))
after=$((2 + RANDOM % 14))
rc=$(killed_run gk3.log "$victim" "$after" --pp 1 --dp 4 --zero 3 "${gpt_args[@]}" --log-every 1 --checkpoint-every 4 --checkpoint gk3.ckpt)
if expect_rc "gpt --zero 3 (1 x 4), rank $victim killed after step $after, --max-restarts 3" "$rc" 0 gk3.log; then
  if ! grep -q "worker $victim killed by signal 9; stopping the others" gk3.log ||
    ! grep -q "gpt: restart 1: " gk3.log; then
    fail "gpt --zero 3 killed: no restart"; sed 's/^/    /' gk3.log
  else
    near "gpt --zero 3 (1 x 4), rank $victim killed after step $after and restarted" "$base" "$(gpt_final gk3.log)"
  fi
fi
# A node lost for good: two launchers as two nodes (--nnodes 1:2), gpt 2 x 2
# with --dp 0 (its replicas follow the world's size); node 1's launcher
# SIGKILLed (its workers die with it) after a random step. Node 0's launcher
# notices, waits --last-call for it, and goes on alone: gpt resumes 2 x 1
# from its newest checkpoint with the same global batch, and ends on the
# uninterrupted 2 x 2 loss (the same windows each step; only the sums'
# order differs).
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
after=$((2 + RANDOM % 14))
elastic=(--nnodes 1:2 --master-addr 127.0.0.1 --master-port "$port" --max-restarts 3 --last-call 2 --nproc-per-node 2)
gpt_elastic=("$bin/gpt" --pp 2 --dp 0 "${gpt_args[@]}" --log-every 1 --checkpoint-every 4 --checkpoint "$tmp/ge.ckpt")
timeout 120 "$run" "${elastic[@]}" --node-rank 0 "${gpt_elastic[@]}" >ge0.log 2>&1 &
node0=$!
timeout 120 "$run" "${elastic[@]}" --node-rank 1 "${gpt_elastic[@]}" >ge1.log 2>&1 &
node1=$!
for ((i = 0; i < 2400; ++i)); do
  grep -q "step $after/" ge0.log && break
  sleep 0.02
done
kill -9 "$(pgrep -P "$node1" -x tandem-run || echo "$node1")" 2>/dev/null
wait "$node0"; rc=$?
wait "$node1" 2>/dev/null
if expect_rc "gpt on two elastic nodes, node 1 lost after step $after" "$rc" 0 ge0.log; then
  if ! grep -q "node 1's launcher is gone" ge0.log ||
    ! grep -q "round 1: 1 of 2 node(s) (0), WORLD_SIZE 2" ge0.log ||
    ! grep -q "2 x 1 (pp x dp)" ge0.log; then
    fail "gpt elastic: no resharded restart on one node"; sed 's/^/    /' ge0.log
  else
    near "gpt on two nodes, then one" "$(gpt_final g22.log)" "$(gpt_final ge0.log)"
    echo "ok: gpt 2 x 2 on two nodes, node 1 lost after step $after, ends on one node as 2 x 1 at $(gpt_final ge0.log) (uninterrupted $(gpt_final g22.log))"
  fi
fi
# A fresh run into a directory of an older run's checkpoints starts afresh.
rc=$(launch gf.log 4 gpt "${gpt_args[@]}" --steps 8 --checkpoint gk.ckpt)
expect_rc "gpt fresh into an older run's checkpoints" "$rc" 0 gf.log &&
  { grep -q "a fresh run: removed 2 older checkpoint(s)" gf.log || fail "gpt fresh run: no removal said"; }
# --zero 2's checkpoint, every rank its own part (checkpoint::JobState): it
# resumes on 2 ranks and, by names, on 1.
rc=$(launch gy1.log 2 gpt --pp 1 --dp 2 "${gpt_args[@]}" --zero 2 --stop-at 10 --checkpoint gy.ckpt)
expect_rc "gpt 1 x 2 --zero 2 --stop-at 10" "$rc" 0 gy1.log
[[ -f gy.ckpt/step-0000000010/part-1.bin ]] || fail "gpt --zero 2: rank 1 wrote no part"
cp -r gy.ckpt gy2.ckpt
cp -r gy.ckpt gy4.ckpt
rc=$(launch gy2.log 2 gpt --pp 1 --dp 2 "${gpt_args[@]}" --zero 2 --resume --checkpoint gy.ckpt)
expect_rc "gpt 1 x 2 --zero 2 --resume" "$rc" 0 gy2.log && near "gpt --zero 2 resumed" "$base" "$(gpt_final gy2.log)"
rc=$(launch gy3.log 1 gpt --pp 1 --dp 1 "${gpt_args[@]}" --zero 2 --resume --checkpoint gy2.ckpt)
expect_rc "gpt --zero 2 on 2 ranks resumed on 1" "$rc" 0 gy3.log && near "gpt --zero 2 resumed on 1 rank" "$base" "$(gpt_final gy3.log)"
timeout 120 "$bin/gpt" --pp 1 --dp 2 --steps 10 --sample 0 --checkpoint g0.ckpt >g0.log 2>&1
expect_rc "gpt alone (spawning its 2 workers)" "$?" 0 g0.log
gpt_bad() {  # gpt_bad NPROC PATTERN ARGS...
  local n="$1" pattern="$2"
  shift 2
  local rc
  rc=$(launch e.log "$n" gpt "$@")
  if expect_rc "gpt $* on $n" "$rc" 2 e.log; then
    grep -q -- "$pattern" e.log || { fail "gpt $*: no message matching '$pattern'"; cat e.log; }
  fi
}
gpt_bad 4 "--pp 3 --dp 2 needs 6 processes, not 4" --pp 3
gpt_bad 4 "--zero 3 trains the whole model on every rank: pass --pp 1" --zero 3
gpt_bad 4 "--heads 5 does not divide --dim 64" --heads 5
gpt_bad 2 "is at step 20; pass a larger --steps" --pp 1 --dp 2 --resume --checkpoint gr.ckpt --steps 20
gpt_bad 4 "--resume: no checkpoint in" --resume --checkpoint "$tmp/none.ckpt"
# A fresh run does not clear another program's steps.
gpt_bad 4 "holds char_lm's checkpoints, not gpt's" --steps 4 --checkpoint a.ckpt
rc=$(launch e.log 2 char_lm --steps 4 --checkpoint gy4.ckpt)
expect_rc "char_lm into gpt's checkpoints" "$rc" 2 e.log &&
  { grep -q "holds gpt's checkpoints, not char_lm's" e.log || fail "char_lm into gpt's: no message"; }
# resumes LOG NPROC WHAT CKPT ARGS...: gpt ARGS --resume from CKPT on NPROC
# ranks exits 0 and ends at the 1 x 1 loss.
resumes() {
  local log="$1" n="$2" what="$3" ckpt="$4" rc
  shift 4
  rc=$(launch "$log" "$n" gpt "$@" "${gpt_args[@]}" --resume --checkpoint "$ckpt")
  expect_rc "$what" "$rc" 0 "$log" && near "$what" "$base" "$(gpt_final "$log")"
}
# The pipeline's steps and --zero 2's hold the same names: each resumes the other's.
resumes gx1.log 4 "gpt --zero 2's checkpoint resumed by the pipeline (2 x 2)" gy4.ckpt
resumes gx2.log 2 "gpt 2 x 2's checkpoint resumed by --zero 2 (1 x 2)" gr6.ckpt --pp 1 --dp 2 --zero 2
# --zero 3's checkpoint: each rank the slices of the parameters its FSDP
# shards hold, and of their Adam state. It resumes on 2 ranks (exactly), on
# 1, as the pipeline and under --zero 2; the pipeline's resumes under --zero 3.
rc=$(launch gw1.log 2 gpt --pp 1 --dp 2 "${gpt_args[@]}" --zero 3 --stop-at 10 --checkpoint gw.ckpt)
expect_rc "gpt 1 x 2 --zero 3 --stop-at 10" "$rc" 0 gw1.log
[[ -f gw.ckpt/step-0000000010/part-1.bin ]] || fail "gpt --zero 3: rank 1 wrote no part"
for c in gw2 gw3 gw4; do cp -r gw.ckpt "$c.ckpt"; done
rc=$(launch gw2.log 2 gpt --pp 1 --dp 2 "${gpt_args[@]}" --zero 3 --resume --checkpoint gw.ckpt)
if expect_rc "gpt 1 x 2 --zero 3 --resume" "$rc" 0 gw2.log; then
  if [[ -z $(final_line gz3.log) || "$(final_line gz3.log)" != "$(final_line gw2.log)" ]]; then
    fail "gpt --zero 3 resumed: '$(final_line gw2.log)', uninterrupted: '$(final_line gz3.log)'"
  else
    echo "ok: gpt --zero 3 resumed ends as the uninterrupted run: $(final_line gw2.log)"
  fi
fi
resumes gw3.log 1 "gpt --zero 3 on 2 ranks resumed on 1" gw2.ckpt --pp 1 --dp 1 --zero 3
resumes gw4.log 4 "gpt --zero 3's checkpoint resumed by the pipeline (2 x 2)" gw3.ckpt
resumes gw5.log 2 "gpt --zero 3's checkpoint resumed by --zero 2" gw4.ckpt --pp 1 --dp 2 --zero 2
resumes gw6.log 2 "gpt 2 x 2's checkpoint resumed by --zero 3 (1 x 2)" gr7.ckpt --pp 1 --dp 2 --zero 3

finish check_examples
