# What the example checks share (sourced by check_examples.sh,
# check_failures.sh and check_parallel.sh, which set bin, the folder of tandem-run and the
# examples): a scratch folder to run in, counting failures, running a job
# under tandem-run, and reading its final loss.
run="$bin/tandem-run"
tmp="$(mktemp -d)"; [[ -n ${KEEP_TMP:-} ]] && echo "scratch: $tmp"
[[ -n ${KEEP_TMP:-} ]] || trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1
failures=0

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# launch LOG NPROC PROGRAM ARGS...: runs it (at most 120 s), output in LOG; prints the exit code.
launch() {
  local log="$1" nproc="$2" program="$3"
  shift 3
  timeout 120 "$run" --nproc-per-node "$nproc" "$bin/$program" "$@" >"$log" 2>&1
  echo $?
}

# expect_rc WHAT RC WANT LOG
expect_rc() {
  if [[ $2 != "$3" ]]; then
    fail "$1: exit code $2, expected $3; its output:"
    sed 's/^/    /' "$4"
    return 1
  fi
  echo "ok: $1 (exit $2)"
}

# near WHAT A B: passes when losses A and B agree within 1e-4
near() {
  if [[ -z $2 || -z $3 ]] || ! awk -v a="$2" -v b="$3" 'BEGIN { d = a - b; exit !(d < 1e-4 && d > -1e-4) }'; then
    fail "$1 ends at loss '$3', expected '$2'"
  else
    echo "ok: $1 ends at loss $3 ($2)"
  fi
}

# pids_of TAG: the workers' pids of the job whose environment has
# CHECK_TAG=TAG, as "RANK:PID" lines, in its first round.
pids_of() {
  local f p env rank
  # (one grep over every process's environment: a scan forking per process
  # can take longer, on a busy machine, than the steps it should stop)
  for f in $(grep -lzx "CHECK_TAG=$1" /proc/[0-9]*/environ 2>/dev/null); do
    p=${f%/environ}
    env=$({ tr '\0' '\n' <"$f"; } 2>/dev/null) || continue
    grep -qx "TANDEM_RESTART_COUNT=0" <<<"$env" || continue
    rank=$(sed -n 's/^RANK=//p' <<<"$env")
    [[ -n $rank ]] && echo "$rank:${p#/proc/}"
  done
}
# await LOG PATTERN [TRIES]: waits (20 ms a try) until LOG matches PATTERN.
await() {
  local i
  for ((i = 0; i < ${3:-3000}; ++i)); do
    grep -q -- "$2" "$1" && return 0
    sleep 0.02
  done
  return 1
}

# The final loss line of a log, and gpt's final loss alone.
final_line() { grep -o 'final step .* loss [0-9.a-z]*' "$1"; }
gpt_final() { final_line "$1" | awk '{print $NF}'; }

# finish NAME: the verdict, as the script's exit code.
finish() {
  if ((failures)); then
    echo "$1: $failures failure(s)"
    exit 1
  fi
  echo "$1: all passed"
}
