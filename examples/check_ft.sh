#!/usr/bin/env bash
# Per-step fault tolerance from outside, as an operator sees it (ctest entry
# "examples_ft"). Usage: check_ft.sh BIN_DIR (BIN_DIR holds tandem-run and
# ft_mlp, e.g. build/bin).
#
# Every job is ft_mlp's replicas under tandem-run --replace-failed. After
# each, the committed steps' quorum sizes (what the replicas printed) give
# the reference run (ft_mlp --reference), and every replica alive at the
# end must print the same final line as it (1e-5 relative): nothing was
# skipped, trained twice or applied by some replicas only.
#  a. a replica SIGKILLed at a random step: the survivors fail that step
#     alone and go on; the replacement is healed from a peer and trains;
#  b. a failure every 2 to 3 s until the job ends (about 30 s), each
#     replica in turn (a replacement that comes as the job ends learns
#     that it finished and exits 0);
#  c. a failure while a replacement heals: the newcomer itself killed as it
#     starts, and (another run) the peer it heals from;
#  d. a replica stopped (SIGSTOP) for 4 s, longer than the heartbeat
#     timeout: the others go on without it; let go, it rejoins and is healed;
#  e. a newcomer with another model, with other options, and one without
#     the job's cluster token: each refused by name, the job unaffected;
#  f. no quorum left (every replica needed, the replacements spent): the
#     job restarts as a whole from its newest checkpoint and ends as the
#     reference; every replica killed at once with no checkpoint: the job
#     ends at once with the lost step named;
#  g. the quorum kept in a 3-member etcd cluster (TANDEM_ETCD), a node (a
#     launcher) a replica: node 0's launcher and its worker killed, the
#     other nodes train on to the end; the launchers' own rendezvous in
#     etcd (--rdzv-endpoint): the coordinator they elected killed, another
#     takes over and the job goes on with the nodes left; etcd stopped
#     mid-job, and a launcher started without it;
#  h. a replica cut off by the network rather than killed (its node a
#     network namespace whose veth link goes down for 4 s): the others go
#     on without it; back, it rejoins and is healed;
#  i. HSDP 2 x 2 (replicas of two processes sharding the model): a rank
#     killed at a random step; its replica sits out until the replacement
#     is back, then both its ranks are healed rank by rank; and a random
#     rank killed every 2 to 3 s until the job ends; both holders of one
#     shard killed at once: the job ends at once naming the lost shard;
#     the replacements spent: the job restarts from its sharded checkpoint;
#  j. a replica killed with DistributedDataParallel's buckets averaging in
#     backward (ft_mlp --ddp) instead of Manager::allreduce_grads;
#  k. pp x dp 2 x 2 (ft_mlp --pipeline: each replica a pipeline row of two
#     stages, a Pipe over the row's own RPC agent): a rank killed at a
#     random step, then a random rank every 2 to 3 s; a rank stopped by
#     SIGSTOP for 4 s; a replacement killed as it starts; both holders of a
#     stage killed: the job ends at once naming it; the replacements
#     spent: the job restarts from the rows' checkpoint;
#  l. the same for gpt (gpt --ft), against its own --reference.
set -uo pipefail
bin="$(readlink -f "${1:?usage: check_ft.sh BIN_DIR}")"
here="$(dirname "$(readlink -f "$0")")"
# shellcheck source=check_lib.sh
source "$here/check_lib.sh"
# The program the jobs run (start, ft_pid, verdict): ft_mlp, and gpt in (l).
prog=ft_mlp

# ft_pid TAG RANK: the live worker of RANK in the job tagged TAG (the newest).
ft_pid() {
  local p env best="" state
  for p in /proc/[0-9]*; do
    env=$({ tr '\0' '\n' <"$p/environ"; } 2>/dev/null) || continue
    grep -qx "CHECK_TAG=$1" <<<"$env" || continue
    grep -qx "RANK=$2" <<<"$env" || continue
    grep -q "$prog" "$p/cmdline" 2>/dev/null || continue
    state=$(awk '{print $3}' "$p/stat" 2>/dev/null)
    [[ $state == Z || -z $state ]] && continue
    best=${p#/proc/}
  done
  echo "$best"
}

# start LOG NPROC LAUNCHER_FLAGS -- FT_MLP_ARGS: the job in the background ($job, $tag).
start() {
  local log="$1" nproc="$2"
  shift 2
  local flags=()
  while [[ $1 != -- ]]; do flags+=("$1"); shift; done
  shift
  tag="ft-$$-$RANDOM"
  CHECK_TAG="$tag" timeout 170 "$run" "${flags[@]}" --nproc-per-node "$nproc" \
    "$bin/$prog" "$@" >"$log" 2>&1 &
  job=$!
}

# verdict WHAT LOG ALIVE ARGS...: the job ($job, or with none $job_rc) ended 0, ALIVE replicas printed
# the same final line, and it is the reference's for the quorums printed.
verdict() {
  local what="$1" log="$2" alive="$3" rc ks finals distinct ref steps
  shift 3
  if [[ -n $job ]]; then
    wait "$job"
    rc=$?
  else
    rc=$job_rc  # (a job of several launchers: its status, given)
  fi
  expect_rc "$what" "$rc" 0 "$log" || return 1
  # Each replica ends with a final line, or its replacement came as the job
  # ended and says 'late:' (a replica may print its final line and be killed
  # before it exits: then it has both).
  local ended
  ended=$(grep -o '^\[[0-9]*\]: \(final step\|late: \)' "$log" | cut -d: -f1 | sort -u | wc -l)
  steps=$(grep -o '^\[[0-9]*\]: step [0-9]* k [0-9]*' "$log" | awk '{print $3}' | sort -n -u | wc -l)
  ks=$(grep -o '^\[[0-9]*\]: step [0-9]* k [0-9]*' "$log" | awk '{print $3, $5}' | sort -n -u -k1,1 |
    awk '{print $2}' | paste -sd,)
  finals=$(grep -o 'final step .*' "$log")
  distinct=$(sort -u <<<"$finals" | wc -l)
  if [[ $ended != "$alive" || $distinct != 1 ]]; then
    fail "$what: $alive replicas should end alike; they printed:"
    sed 's/^/    /' <<<"$finals"
    grep -v "step [0-9]* k" "$log" | tail -25 | sed 's/^/    | /'
    return 1
  fi
  ref=$("$bin/$prog" "$@" --reference "$ks")
  if ! awk -v a="$(head -1 <<<"$finals")" -v b="$ref" 'BEGIN {
      n = split(a, x, " "); split(b, y, " ");
      if (x[3] != y[3]) exit 1;
      for (i = 5; i <= n; i += 2) { d = x[i] - y[i]; if (d < 0) d = -d; if (d > 1e-5 * (y[i] < 0 ? -y[i] : y[i]) + 1e-9) exit 1 }
    }'; then
    fail "$what: the replicas end at '$(head -1 <<<"$finals")', the reference at '$ref'"
    return 1
  fi
  echo "ok: $what: $steps steps, quorums $(tr ',' '\n' <<<"$ks" | uniq -c | awk '{printf "%sx%s ", $1, $2}'), final as the reference"
}

# after LOG N: waits until some replica printed committed step N.
after() { await "$1" "\]: step $2 k" 6000; }

args=(--steps 120 --step-ms 15 --width 128)

# a. One replica killed at a random step (250 steps: its replacement,
# a second or so to start, joins well before the end).
victim=$((RANDOM % 3)) at=$((20 + RANDOM % 40))
aargs=(--steps 250 --step-ms 15 --width 128)
start a.log 3 --replace-failed 3 -- "${aargs[@]}"
after a.log "$at"
kill -KILL "$(ft_pid "$tag" "$victim")"
verdict "a. replica $victim killed after step $at" a.log 3 "${aargs[@]}" && {
  failed=$(grep -o 'failed step [0-9]*' a.log | sort -u | wc -l)
  [[ $failed == 1 ]] || fail "a. $failed steps failed, the killed one alone should"
  grep -q "^\[$victim\]: healed bytes" <(grep -A1000 "starting it again" a.log) ||
    fail "a. the replacement of replica $victim was not healed"
}

# b. A failure every 2 to 3 s until the job ends (about 30 s), each
# replica in turn.
bargs=(--steps 900 --step-ms 20 --width 128)
start b.log 3 --replace-failed 40 -- "${bargs[@]}"
after b.log 5
healed=$(grep -c "\]: healed bytes" b.log)
kills=0
while kill -0 "$job" 2>/dev/null; do
  sleep "$(awk -v m=$((2000 + RANDOM % 1000)) 'BEGIN { print m / 1000 }')"
  # The last victim's replacement back first (healed): killing faster than a
  # replacement can start on a loaded machine would leave no replica with
  # the newest state, which is f's case, not this one.
  for ((i = 0; i < 1500; ++i)); do
    (($(grep -c "\]: healed bytes" b.log) >= healed + kills)) && break
    grep -q "final step" b.log && break
    sleep 0.02
  done
  grep -q "final step" b.log && break
  pid=$(ft_pid "$tag" $((kills % 3)))
  [[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null && kills=$((kills + 1))
done
wait "$job"
job_rc=$? job=""
verdict "b. $kills replicas killed, one every 2 to 3 s" b.log 3 "${bargs[@]}"
((kills >= 5)) || fail "b. only $kills kills: the job ended too soon to test repeated failures"

# c. A failure while a replacement heals: the newcomer, then its source.
cargs=(--steps 150 --step-ms 15 --width 1024)
start c1.log 3 --replace-failed 3 -- "${cargs[@]}"
after c1.log 30
kill -KILL "$(ft_pid "$tag" 1)"
await c1.log "^\[1\]: started.*replacement 1" 1500
kill -KILL "$(ft_pid "$tag" 1)"
verdict "c. the newcomer killed as it starts" c1.log 3 "${cargs[@]}"
start c2.log 3 --replace-failed 3 -- "${cargs[@]}"
after c2.log 30
kill -KILL "$(ft_pid "$tag" 2)"
await c2.log "^\[2\]: started.*replacement 1" 1500
kill -KILL "$(ft_pid "$tag" 0)"  # the first member: the source of the heal
verdict "c. the source killed as the newcomer starts" c2.log 3 "${cargs[@]}"

# d. A replica stopped longer than the heartbeat timeout (1.5 s).
dargs=(--steps 400 --step-ms 15 --width 128)
start d.log 3 --replace-failed 0 -- "${dargs[@]}"
after d.log 20
pid=$(ft_pid "$tag" 2)
kill -STOP "$pid"
sleep 4
kill -CONT "$pid"
verdict "d. replica 2 stopped for 4 s" d.log 3 "${dargs[@]}" && {
  # (healed once at the start, from the first member, and again once let go)
  (($(grep -c "^\[2\]: healed bytes" d.log) >= 2)) ||
    fail "d. replica 2 was not healed after it was let go"
  grep -q "k 2 " d.log || fail "d. the others did not train without replica 2"
}

# e. Newcomers that do not belong: another model, other options, no token.
eargs=(--steps 600 --step-ms 15 --width 128 --replicas 3)  # (long enough for three intruders)
start e.log 2 --replace-failed 0 -- "${eargs[@]}"
after e.log 10
pid=$(ft_pid "$tag" 0)
mapfile -t envs < <(tr '\0' '\n' <"/proc/$pid/environ" | grep -E '^(MASTER_ADDR|MASTER_PORT|TORCHELASTIC_USE_AGENT_STORE|TANDEM_TOKEN|WORLD_SIZE)=')
intruder() {  # intruder WHAT PATTERN ENV... -- ARGS...
  local what="$1" pattern="$2" out rc
  shift 2
  local extra=()
  while [[ $1 != -- ]]; do extra+=("$1"); shift; done
  shift
  out=$(env "${envs[@]}" RANK=2 "${extra[@]}" timeout 30 "$bin/ft_mlp" "$@" 2>&1)
  rc=$?
  # (1: refused; 78: a quorum error, which --replace-failed does not replace)
  if [[ $rc != 1 && $rc != 78 ]] || ! grep -q "$pattern" <<<"$out"; then
    fail "e. $what: exit $rc, expected 1 or 78 naming '$pattern'; it printed:"
    sed 's/^/    /' <<<"$out" | tail -5
  else
    echo "ok: e. $what: $(grep -o 'ft::Manager.*' <<<"$out" | cut -c1-160)"
  fi
}
intruder "another model" "param/0.weight" -- --width 64 --replicas 3 --steps 5
intruder "other options" "batch 32.*batch 16" -- --width 128 --replicas 3 --batch 16 --steps 5
intruder "no cluster token" "cluster token" TANDEM_TOKEN=forged -- "${eargs[@]}"
verdict "e. the job with its intruders refused" e.log 2 "${eargs[@]}"

# restart_after_spent LOG NPROC RANK WHAT ARGS...: a job of NPROC whose
# rank RANK has one replacement: that rank killed, and killed again once its
# replacement committed a step of its own (it may need no heal, having read
# a checkpoint at the committed step). No quorum is left (ARGS need every
# replica), so the job restarts as a whole from its newest checkpoint and
# must end as the reference run.
restart_after_spent() {
  local log=$1 nproc=$2 rank=$3 what=$4
  shift 4
  start "$log" "$nproc" --replace-failed 1 --max-restarts 1 -- "$@"
  after "$log" 25
  kill -KILL "$(ft_pid "$tag" "$rank")"
  for ((n = 0; n < 1500; ++n)); do
    awk -v r="$rank" '$0 ~ "^\\[" r "\\]: started.*replacement 1" { on = 1 }
      on && $0 ~ "^\\[" r "\\]: step [0-9]* k" { m++ } END { exit !(m >= 1) }' "$log" && break
    sleep 0.02
  done
  sleep 0.3
  kill -KILL "$(ft_pid "$tag" "$rank")"
  verdict "$what" "$log" "$nproc" "$@" && {
    # (the whole job, not a replacement alone, which reads the checkpoint too)
    grep -q "start every worker again (restart 1 of 1)" "$log" && grep -q "resumed [1-9]" "$log" ||
      fail "$what: the job did not restart from its checkpoint"
  }
}

# f. No quorum left: the job restarts from its checkpoint.
restart_after_spent f.log 3 2 "f. the replacements spent, the job restarted" \
  --steps 200 --step-ms 15 --width 128 --min-replicas 3 --checkpoint-every 10 --checkpoint f.ckpt
# Every replica killed at once, and no checkpoint to restart from: the
# replacements find the newest state lost and end the job at once (exit 78,
# which --replace-failed does not replace), not after the quorum's timeout.
start f2.log 2 --replace-failed 4 -- --steps 400 --step-ms 15 --width 128
after f2.log 20
t0=$SECONDS
kill -KILL "$(ft_pid "$tag" 0)" "$(ft_pid "$tag" 1)"
wait "$job"
rc=$?
if [[ $rc != 78 ]] || ! grep -q "is gone, and with them the job's newest committed step" f2.log ||
  ((SECONDS - t0 > 30)); then
  fail "f. every replica killed: exit $rc after $((SECONDS - t0)) s, expected 78 at once naming the lost step"
  sed 's/^/    /' f2.log | grep -v "step [0-9]* k" | tail -8
else
  echo "ok: f. every replica killed: the job ends in $((SECONDS - t0)) s: $(grep -o "every replica of quorum.*" f2.log | head -1 | cut -c1-120)"
fi

# g. The quorum in a 3-member etcd cluster, three nodes (a launcher each):
# node 0's launcher killed with its worker; the other nodes go on.
if [[ -x /usr/bin/etcd ]]; then
  # Seven free ports below the kernel's ephemeral range (32768 and up), so
  # that no connection's own port can take one before it is listened on.
  read -r -a ports < <(python3 -c '
import random, socket
got = []
while len(got) < 7:
    p = random.randrange(20000, 32000)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        s.close()
    if p not in got:
        got.append(p)
print(" ".join(map(str, got)))')
  cluster="m0=http://127.0.0.1:${ports[3]},m1=http://127.0.0.1:${ports[4]},m2=http://127.0.0.1:${ports[5]}"
  etcd_pids=()
  for i in 0 1 2; do
    /usr/bin/etcd --name "m$i" --data-dir "$tmp/etcd$i" --logger zap --log-outputs "$tmp/etcd$i.log" \
      --listen-client-urls "http://127.0.0.1:${ports[$i]}" --advertise-client-urls "http://127.0.0.1:${ports[$i]}" \
      --listen-peer-urls "http://127.0.0.1:${ports[$((i + 3))]}" \
      --initial-advertise-peer-urls "http://127.0.0.1:${ports[$((i + 3))]}" \
      --initial-cluster "$cluster" --initial-cluster-state new >/dev/null 2>&1 &
    etcd_pids+=($!)
  done
  export TANDEM_ETCD="127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}"
  export TANDEM_TOKEN="check-ft-$RANDOM$RANDOM"  # the nodes' shared token
  gargs=(--steps 200 --step-ms 15 --width 128)
  node_pids=()
  gtag="ft-g-$$"
  for r in 0 1 2; do
    CHECK_TAG="$gtag" timeout 170 "$run" --nnodes 3 --node-rank "$r" --master-addr 127.0.0.1 \
      --master-port "${ports[6]}" --nproc-per-node 1 "$bin/ft_mlp" "${gargs[@]}" >"g$r.log" 2>&1 &
    node_pids+=($!)
  done
  after g1.log 40
  worker0=$(ft_pid "$gtag" 0)
  # (the launcher itself, timeout's child)
  kill -KILL "$(pgrep -P "${node_pids[0]}")"
  [[ -n $worker0 ]] && kill -KILL "$worker0" 2>/dev/null
  wait "${node_pids[1]}"; rc1=$?
  wait "${node_pids[2]}"; rc2=$?
  wait "${node_pids[0]}" 2>/dev/null
  cat g1.log g2.log >g.log
  if [[ $rc1 != 0 || $rc2 != 0 ]]; then
    fail "g. node 0 killed: nodes 1 and 2 exited $rc1 and $rc2"; sed 's/^/    /' g.log | tail -20
  else
    job="" job_rc=0
    verdict "g. node 0's launcher and worker killed, the quorum in etcd" g.log 2 "${gargs[@]}"
  fi
  unset TANDEM_ETCD
  # The launchers' own rendezvous in etcd (--rdzv-endpoint): three nodes of
  # a restart-the-world job (ft_mlp --restart, --nnodes 2:3 --max-restarts
  # 2). The launcher etcd elected to coordinate is killed with its worker:
  # the others elect another, which starts the next round with the two
  # left; they resume from the checkpoint and end. Then etcd is stopped
  # altogether mid-job: the coordinator says so, and the job ends as it
  # would have.
  etcd="127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}"
  rdzv_job() {  # rdzv_job TAG ID LOGPREFIX ARGS...: three launchers; their pids in rdzv_pids
    local tag=$1 id=$2 prefix=$3 r
    shift 3
    rdzv_pids=()
    for r in 0 1 2; do
      CHECK_TAG="$tag" timeout 170 "$run" --nnodes 2:3 --max-restarts 2 --last-call 3 \
        --rdzv-endpoint "$etcd" --rdzv-id "$id" --nproc-per-node 1 "$bin/ft_mlp" "$@" \
        >"$prefix$r.log" 2>&1 &
      rdzv_pids+=($!)
    done
  }
  rdzv_after() {  # rdzv_after LOGPREFIX N: until a node printed committed step N
    for ((n = 0; n < 3000; ++n)); do grep -q "\]: step $2 k" "$1"*.log 2>/dev/null && return; sleep 0.02; done
  }
  rdzv_end() {  # rdzv_end NAME: the three launchers' exits in rcs, their logs in NAME.log
    local r
    rcs=()
    for r in 0 1 2; do
      wait "${rdzv_pids[$r]}"
      rcs+=($?)
    done
    cat "$1"-*.log >"$1.log"
  }
  # (600 steps: the kill after step 60 lands well before the end on a busy machine)
  g2args=(--restart --steps 600 --step-ms 15 --width 128 --checkpoint g2.ckpt)
  rdzv_job "$gtag-2" "g2-$$" g2- "${g2args[@]}"
  rdzv_after g2- 60
  leader=""
  for r in 0 1 2; do grep -q "coordinates the job (elected" "g2-$r.log" && leader=$r; done
  worker0=$(ft_pid "$gtag-2" 0)
  kill -KILL "$(pgrep -P "${rdzv_pids[$leader]}")" "$worker0"
  rdzv_end g2
  survivors=$(grep -c "final step 600" g2.log)
  bad_exit=0
  for r in 0 1 2; do [[ $r != "$leader" && ${rcs[$r]} != 0 ]] && bad_exit=1; done
  if [[ -z $leader ]] || ((survivors != 2 || bad_exit)) ||
    ! grep -q "coordinates the job (elected in etcd, generation 2)" g2.log ||
    ! grep -q "round 0's coordinator was lost; the job goes on (restart 1 of 2)" g2.log ||
    ! grep -q "resumed [1-9]" g2.log; then
    fail "g. the elected coordinator (node $leader) killed: exits ${rcs[*]}, $survivors final lines"
    grep -v "step [0-9]* k" g2.log | sed 's/^/    /' | tail -25
  else
    echo "ok: g. the coordinator elected in etcd killed with its worker: $(grep -o "round 1: 2 of 3.*" g2.log | head -1 | cut -c1-60); exits ${rcs[*]}"
  fi
  # The coordinator replaced behind its back (as if it had been cut off
  # long enough): etcd names a launcher at an address where nobody listens.
  # The old coordinator sees it, stops its workers and leaves; the others
  # cannot reach the one named, replace it, and end the job on two nodes.
  rdzv_job "$gtag-4" "g4-$$" g4- --restart --steps 300 --step-ms 15 --width 128 --checkpoint g4.ckpt
  rdzv_after g4- 40
  python3 - "127.0.0.1:${ports[0]}" "tandem/launch/g4-$$/coordinator" "9 127.0.0.1:1" <<'PY'
import base64, json, sys, urllib.request
b64 = lambda s: base64.b64encode(s.encode()).decode()
body = json.dumps({"key": b64(sys.argv[2]), "value": b64(sys.argv[3])}).encode()
urllib.request.urlopen(urllib.request.Request("http://" + sys.argv[1] + "/v3/kv/put", data=body,
                                              method="POST"), timeout=10).read()
PY
  rdzv_end g4
  if [[ $(tr ' ' '\n' <<<"${rcs[*]}" | sort | paste -sd' ') != "0 0 1" ]] ||
    (($(grep -c "final step 300" g4.log) != 2)) ||
    ! grep -q "etcd names another coordinator ('9 127.0.0.1:1'): this launcher was replaced" g4.log ||
    ! grep -q "coordinates the job (elected in etcd, generation 10)" g4.log; then
    fail "g. the coordinator replaced behind its back: exits ${rcs[*]}"
    grep -v "step [0-9]* k" g4.log | sed 's/^/    /' | tail -25
  else
    echo "ok: g. the coordinator replaced behind its back leaves; the others elect another and end the job, exits ${rcs[*]}"
  fi
  rdzv_job "$gtag-3" "g3-$$" g3- --restart --steps 300 --step-ms 15 --width 128 --checkpoint g3.ckpt
  rdzv_after g3- 40
  kill "${etcd_pids[@]}" 2>/dev/null
  wait "${etcd_pids[@]}" 2>/dev/null
  rdzv_end g3
  if [[ ${rcs[*]} != "0 0 0" ]] || (($(grep -c "final step 300" g3.log) != 3)) ||
    ! grep -q "etcd is out of reach" g3.log; then
    fail "g. etcd stopped mid-job: exits ${rcs[*]}"
    grep -v "step [0-9]* k" g3.log | sed 's/^/    /' | tail -20
  else
    echo "ok: g. etcd stopped mid-job: the coordinator says so ($(grep -o "etcd is out of reach" g3.log | head -1)) and the job ends, exits ${rcs[*]}"
  fi
  # Without etcd a launcher cannot start: a clear error naming the members.
  out=$("$run" --nnodes 2 --max-restarts 1 --rdzv-endpoint "$etcd" --nproc-per-node 1 true 2>&1)
  rc=$?
  if [[ $rc != 1 ]] || ! grep -q "no member of the cluster answers.*127.0.0.1:${ports[2]}" <<<"$out"; then
    fail "g. no etcd: exit $rc, said: $out"
  else
    echo "ok: g. no etcd: $(cut -c1-120 <<<"$out")"
  fi
  unset TANDEM_TOKEN
else
  echo "skipped: g. no etcd here (apt-get install etcd-server)"
fi

# h. A replica cut off by the network, not killed: its node (a network
# namespace joined to this one by a veth pair) loses its link for 4 s.
if [[ $(id -u) == 0 ]] && command -v ip >/dev/null && command -v python3 >/dev/null; then
  ns="tdft$$" hif="tfh$$" nif="tfn$$" net="10.232.$((20 + RANDOM % 200))"
  in_ns() { ip netns exec "$ns" "$@"; }
  if ip netns add "$ns" 2>/dev/null && ip link add "$hif" type veth peer name "$nif" &&
    ip link set "$nif" netns "$ns" && ip addr add "$net.1/24" dev "$hif" && ip link set "$hif" up &&
    in_ns ip addr add "$net.2/24" dev "$nif" && in_ns ip link set "$nif" up && in_ns ip link set lo up; then
    hport=$(python3 -c '
import random, socket
while True:
    p = random.randrange(20000, 32000)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); print(p); break
    except OSError:
        pass
    finally:
        s.close()')
    export TANDEM_TOKEN="check-ft-$RANDOM$RANDOM"
    hargs=(--steps 400 --step-ms 15 --width 128)
    hpids=()
    for r in 0 1 2; do
      wrap=()
      ((r == 2)) && wrap=(ip netns exec "$ns")
      timeout 170 "${wrap[@]}" "$run" --nnodes 3 --node-rank "$r" --master-addr "$net.1" \
        --master-port "$hport" --nproc-per-node 1 "$bin/ft_mlp" "${hargs[@]}" >"h$r.log" 2>&1 &
      hpids+=($!)
    done
    after h0.log 30
    in_ns ip link set "$nif" down
    sleep 4
    in_ns ip link set "$nif" up
    job_rc=0
    for p in "${hpids[@]}"; do wait "$p" || job_rc=$?; done
    cat h0.log h1.log h2.log >h.log
    job=""
    verdict "h. replica 2's link down for 4 s" h.log 3 "${hargs[@]}" && {
      grep -q "k 2 " h.log || fail "h. the others did not train without replica 2"
      (($(grep -c "^\[2\]: healed bytes" h.log) >= 2)) ||
        fail "h. replica 2 was not healed after its link came back"
    }
    unset TANDEM_TOKEN
  else
    fail "h. could not make a network namespace and a veth pair"
  fi
  ip link del "$hif" 2>/dev/null
  ip netns del "$ns" 2>/dev/null
else
  echo "skipped: h. network namespaces need root and iproute2's ip"
fi

# Two replicas of two processes each (ranks 0-1 and 2-3).
# kill_one_rank LOG WHAT ARGS...: a random rank killed at a random step. Its
# replica sits out (the other trains alone) until the replacement is back;
# then the replacement, and its partners (alive, but behind), are healed from
# the other replica's same ranks. With row=N set, two replicas of N
# processes each.
kill_one_rank() {
  local log=$1 what=$2 rs=${row:-2} at=$((20 + RANDOM % 40)) victim r first
  local n=$((2 * rs))
  victim=$((RANDOM % n)) first=$((victim / rs * rs))
  shift 2
  start "$log" "$n" --replace-failed 3 -- "$@"
  after "$log" "$at"
  kill -KILL "$(ft_pid "$tag" "$victim")"
  verdict "$what: rank $victim killed after step $at" "$log" "$n" "$@" && {
    grep -q " k 1 " "$log" || fail "$what: the other replica did not train alone"
    for ((r = first; r < first + rs; ++r)); do
      grep -q "^\[$r\]: healed bytes" <(grep -A1000 "starting it again" "$log") ||
        fail "$what: rank $r (the killed rank's replica) was not healed"
    done
  }
}

# kill_ranks_repeatedly LOG WHAT ARGS...: a failure every 2 to 3 s, a random
# rank each time, until the job ends (about 30 s). Each kill waits for the
# last one's replica to be back (a step of one replica, then one of both,
# since the kill): a stage's holders all killed at once is f's case, not
# this one.
kill_ranks_repeatedly() {
  local log=$1 what=$2 kills=0 mark=1 n pid procs=$((2 * ${row:-2}))
  shift 2
  start "$log" "$procs" --replace-failed 40 -- "$@"
  after "$log" 5
  while kill -0 "$job" 2>/dev/null; do
    sleep "$(awk -v m=$((2000 + RANDOM % 1000)) 'BEGIN { print m / 1000 }')"
    for ((n = 0; kills > 0 && n < 1500; ++n)); do
      tail -n +"$mark" "$log" |
        awk '/ k 1 / { one = 1 } one && / k 2 / { found = 1; exit } END { exit !found }' && break
      grep -q "final step" "$log" && break
      sleep 0.02
    done
    grep -q "final step" "$log" && break
    mark=$(($(wc -l <"$log") + 1))
    pid=$(ft_pid "$tag" $((RANDOM % procs)))
    [[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null && kills=$((kills + 1))
  done
  wait "$job"
  job_rc=$? job=""
  verdict "$what: $kills ranks killed, one every 2 to 3 s" "$log" "$procs" "$@"
  ((kills >= 5)) || fail "$what: only $kills kills: the job ended too soon to test repeated failures"
}

# stop_one_rank LOG WHAT ARGS...: a random rank stopped (SIGSTOP) for 4 s,
# longer than the heartbeat timeout: its replica sits out; let go, the rank
# and its partner are healed and train on (no replacement is started).
stop_one_rank() {
  local log=$1 what=$2 procs=$((2 * ${row:-2})) victim pid
  victim=$((RANDOM % procs))
  shift 2
  start "$log" "$procs" --replace-failed 0 -- "$@"
  after "$log" 20
  pid=$(ft_pid "$tag" "$victim")
  kill -STOP "$pid"
  sleep 4
  kill -CONT "$pid"
  verdict "$what: rank $victim stopped for 4 s" "$log" "$procs" "$@" && {
    grep -q " k 1 " "$log" || fail "$what: the other replica did not train alone"
    (($(grep -c "^\[$victim\]: healed bytes" "$log") >= 1)) ||
      fail "$what: rank $victim was not healed after it was let go"
  }
}

# kill_newcomer LOG WHAT ARGS...: a random rank killed, and its replacement
# killed again as it starts (while its replica is being healed).
kill_newcomer() {
  local log=$1 what=$2 victim=$((RANDOM % 4))
  shift 2
  start "$log" 4 --replace-failed 3 -- "$@"
  after "$log" 20
  kill -KILL "$(ft_pid "$tag" "$victim")"
  await "$log" "^\[$victim\]: started.*replacement 1" 1500
  kill -KILL "$(ft_pid "$tag" "$victim")"
  verdict "$what: rank $victim's replacement killed as it starts" "$log" 4 "$@"
}

# lose_every_holder LOG WHAT R ARGS...: rank R of both replicas killed at
# once: that shard (or stage) of the newest step is nowhere; the job ends at
# once (exit 78), naming the rank, not after the quorum's timeout.
lose_every_holder() {
  local log=$1 what=$2 r=$3 rc t0
  shift 3
  start "$log" 4 --replace-failed 4 -- "$@"
  after "$log" 20
  t0=$SECONDS
  kill -KILL "$(ft_pid "$tag" "$r")" "$(ft_pid "$tag" $((r + 2)))"
  wait "$job"
  rc=$?
  if [[ $rc != 78 ]] || ! grep -q "every rank-$r process of quorum .* is gone" "$log" ||
    ((SECONDS - t0 > 30)); then
    fail "$what: exit $rc after $((SECONDS - t0)) s, expected 78 at once naming rank $r"
    sed 's/^/    /' "$log" | grep -v "step [0-9]* k" | tail -8
  else
    echo "ok: $what: the job ends in $((SECONDS - t0)) s: $(grep -o "every rank-$r process.*" "$log" | head -1 | cut -c1-110)"
  fi
}

# i. HSDP 2 x 2: replicas of two processes, each sharding the model between
# them (FSDP over the replica's group); one rank killed at a random step,
# then one every 2 to 3 s.
kill_one_rank i.log "i. HSDP 2 x 2" --replica-size 2 --steps 150 --step-ms 15 --width 128
kill_ranks_repeatedly i2.log "i. HSDP 2 x 2" --replica-size 2 --steps 700 --step-ms 20 --width 128

# Both holders of shard 0 (rank 0 of each replica) killed at once.
lose_every_holder i3.log "i. shard 0's holders killed" 0 --replica-size 2 --steps 400 \
  --step-ms 15 --width 128

# No quorum left (both replicas needed, rank 3's one replacement spent):
# the job restarts as a whole, each rank reading its shards of the newest
# checkpoint (written by the quorum's first replica, its ranks together).
restart_after_spent i4.log 4 3 "i. HSDP: the replacements spent, the job restarted" \
  --replica-size 2 --steps 200 --step-ms 15 --width 128 --min-replicas 2 \
  --checkpoint-every 10 --checkpoint i4.ckpt

# j. DistributedDataParallel's buckets under the Manager (--ddp: averaged
# in backward over each quorum's group): a replica killed at a random step.
jargs=(--ddp --steps 150 --step-ms 15 --width 128)
victim=$((RANDOM % 3)) at=$((20 + RANDOM % 40))
start j.log 3 --replace-failed 3 -- "${jargs[@]}"
after j.log "$at"
kill -KILL "$(ft_pid "$tag" "$victim")"
verdict "j. DDP: replica $victim killed after step $at" j.log 3 "${jargs[@]}" && {
  grep -q " k 2 " j.log || fail "j. the survivors did not train without replica $victim"
  grep -q "^\[$victim\]: healed bytes" <(grep -A1000 "starting it again" j.log) ||
    fail "j. the replacement of replica $victim was not healed"
}

# k. pp x dp 2 x 2: a replica is a pipeline row (--pipeline: rank 0 of a row
# holds the MLP's first layers and drives a Pipe, rank 1 its last layer, over
# the row's own RPC agent, made anew with each quorum); one rank killed at a
# random step, then one every 2 to 3 s.
kill_one_rank k.log "k. pp x dp 2 x 2" --pipeline --replica-size 2 --steps 150 --step-ms 15 \
  --width 128
kill_ranks_repeatedly k2.log "k. pp x dp 2 x 2" --pipeline --replica-size 2 --steps 700 \
  --step-ms 20 --width 128
stop_one_rank k5.log "k. pp x dp 2 x 2" --pipeline --replica-size 2 --steps 400 --step-ms 15 \
  --width 128
kill_newcomer k6.log "k. pp x dp 2 x 2" --pipeline --replica-size 2 --steps 250 --step-ms 15 \
  --width 128
# Both holders of stage 1 (rank 1 of each row) killed at once.
lose_every_holder k4.log "k. stage 1's holders killed" 1 --pipeline --replica-size 2 \
  --steps 400 --step-ms 15 --width 128
# No quorum left (both rows needed, rank 3's one replacement spent): the job
# restarts as a whole, each rank reading its stage of the newest checkpoint.
restart_after_spent k3.log 4 3 "k. pp x dp: the replacements spent, the job restarted" \
  --pipeline --replica-size 2 --steps 200 --step-ms 15 --width 128 --min-replicas 2 \
  --checkpoint-every 10 --checkpoint k3.ckpt

# l. gpt --ft: the demo's model as pp x dp 2 x 2 under the Manager (each
# row a replica; float64, so that gpt --reference ends on the same
# parameters to 1e-5), and as pp x tp x dp 2 x 2 x 2.
prog=gpt
gpt_args=(--ft --pp 2 --dp 2 --layers 2 --dim 32 --heads 2 --context 32 --batch 8 --chunks 2
  --warmup 5)
kill_one_rank l.log "l. gpt pp x dp 2 x 2" "${gpt_args[@]}" --steps 200
kill_ranks_repeatedly l2.log "l. gpt pp x dp 2 x 2" "${gpt_args[@]}" --steps 1200
stop_one_rank l3.log "l. gpt pp x dp 2 x 2" "${gpt_args[@]}" --steps 500
# With tensor-parallel ranks in the rows: pp x tp x dp 2 x 2 x 2 (rows of 4).
row=4 kill_one_rank l4.log "l. gpt pp x tp x dp 2 x 2 x 2" "${gpt_args[@]}" --tp 2 --steps 250
row=4 kill_ranks_repeatedly l5.log "l. gpt pp x tp x dp 2 x 2 x 2" "${gpt_args[@]}" --tp 2 \
  --steps 600
row=4 stop_one_rank l6.log "l. gpt pp x tp x dp 2 x 2 x 2" "${gpt_args[@]}" --tp 2 --steps 250
# Both holders of stage 1 killed at once: the job ends naming it; and with
# no quorum left (both rows needed, rank 3's one replacement spent), a
# restart of the whole job from the rows' checkpoint (each rank its stage).
lose_every_holder l7.log "l. gpt: stage 1's holders killed" 1 "${gpt_args[@]}" --steps 400
restart_after_spent l8.log 4 3 "l. gpt pp x dp: the replacements spent, the job restarted" \
  "${gpt_args[@]}" --steps 400 --min-replicas 2 --checkpoint-every 10 --checkpoint l8.ckpt
prog=ft_mlp

finish check_ft
