// node 0's launcher (tandem-run's coordination port) against clients that
// do not hold the cluster token: a live two-node job ends exactly as an
// unattacked one does, and no restart is triggered.
#include "test_util.h"

#include <signal.h>

#include "tests/rpc/scripts.h"

using namespace tandem;
using test::kAwait;
using test::run_script;
using test::value_of;

namespace {

// Two nodes with a token, one worker each (/bin/sleep SECONDS), under
// --max-restarts 1; ATTACK runs once node 1 has joined the round. Node 0's
// launcher may be started under a lower descriptor limit (FDS).
std::string two_node_job(const std::string& attack, int seconds = 6, int fds = 0) {
  const std::string limit = fds > 0 ? "ulimit -n " + std::to_string(fds) + "; " : "";
  return std::string(kAwait) + R"sh(
export TANDEM_TOKEN=launcher-attack-test
flags="--nnodes 2 --master-port $P --max-restarts 1 --join-timeout 60 --nproc-per-node 1"
()sh" + limit + R"sh(exec timeout 60 $R $flags --node-rank 0 /bin/sleep )sh" +
         std::to_string(seconds) + R"sh() > $D/n0.log 2>&1 &
n0=$!
timeout 60 $R $flags --node-rank 1 /bin/sleep )sh" +
         std::to_string(seconds) + R"sh( > $D/n1.log 2>&1 &
n1=$!
await $D/n1.log "round 0: node 1" 1
)sh" + attack + R"sh(
wait $n0; echo "rc0=$?"
wait $n1; echo "rc1=$?"
cat $D/n0.log $D/n1.log
)sh";
}

// What an unattacked job says and does not say.
void expect_untouched(const test::RunResult& r) {
  CHECK(value_of(r.output, "rc0") == 0);
  CHECK(value_of(r.output, "rc1") == 0);
  CHECK(r.output.find("every node's workers exited 0") != std::string::npos);
  CHECK(r.output.find("restart 1 of 1") == std::string::npos);
  CHECK(r.output.find("silent") == std::string::npos);
  CHECK(r.output.find("round 1") == std::string::npos);
}

}  // namespace

TEST_CASE("launcher attack: MiBs of lines without the token do not stall node 0") {
  // Five connections a second, each trying to send 5 MiB of pings: each is
  // cut at a join's worth of bytes, read linearly, and the nodes' own
  // heartbeats go on.
  test::RunResult r = run_script(two_node_job(R"sh(
python3 - "$P" <<'PY'
import socket, sys, time
port, sent, tries = int(sys.argv[1]), 0, 0
end = time.time() + 4
while time.time() < end:
    tries += 1
    s = socket.create_connection(("127.0.0.1", port))
    try:
        s.sendall(b"ping\n" * (1 << 20))
    except OSError:
        pass
    s.close()
    time.sleep(0.2)
print("flood_connections=%d" % tries)
PY
)sh"));
  INFO(r.output);
  expect_untouched(r);
  CHECK(value_of(r.output, "flood_connections") >= 5);
  CHECK(r.output.find("never joined (sent more than 8192 bytes before proving the token)") !=
        std::string::npos);
}

TEST_CASE("launcher attack: out of descriptors, node 0 rests its listener instead of spinning") {
  // Node 0 under a low descriptor limit; 60 connections held open fill it.
  test::RunResult r = run_script(two_node_job(R"sh(
launcher=$(pgrep -P $n0 -x tandem-run || echo $n0)
ticks() { awk '{print $14 + $15}' /proc/$launcher/stat; }
python3 - "$P" <<'PY' &
import socket, sys, time
held = []
for _ in range(60):
    try:
        held.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1))
    except OSError:
        break
time.sleep(3.5)
PY
holder=$!
sleep 0.5
before=$(ticks)
sleep 2.5
echo "busy_ticks=$(($(ticks) - before))"
wait $holder
)sh",
                                              8, 20));
  INFO(r.output);
  expect_untouched(r);
  CHECK(r.output.find("accepting a node's connection failed: Too many open files; not accepting "
                      "for 100 ms at a time while it lasts (logged once)") != std::string::npos);
  // A spinning loop would take a core: 250 ticks in 2.5 s.
  CHECK(value_of(r.output, "busy_ticks") >= 0);
  CHECK(value_of(r.output, "busy_ticks") < 40);
}

TEST_CASE("launcher attack: what a peer sends is quoted before node 0 logs it") {
  test::RunResult r = run_script(two_node_job(R"sh(
python3 - "$P" <<'PY'
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.recv(100)
s.sendall(b"\x1b[2J\x1b[H\rtandem-run: every node's workers exited 0\x00\n")
s.recv(4096)
s.close()
PY
)sh"));
  INFO(r.output);
  expect_untouched(r);
  CHECK(r.output.find("not a tandem-run join ('\\x1b[2J\\x1b[H\\rtandem-run: every node's "
                      "workers exited 0\\x00')") != std::string::npos);
  CHECK(r.output.find('\x1b') == std::string::npos);
  CHECK(r.output.find('\r') == std::string::npos);
}

namespace {

// A two-node job whose node 1 dials a relay that forwards both ways to
// node 0 (so the two prove the token to each other through it); once the
// round is on, the relay does MODE: "inject" makes a line each way (a
// failure towards node 0, a stop towards node 1), "drop" leaves out one of
// node 1's lines.
test::RunResult relay_job(const std::string& mode) {
  return run_script(std::string(kAwait) + "mode=" + mode + R"sh(
export TANDEM_TOKEN=launcher-relay-test
Q=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 - "$P" "$Q" "$mode" > $D/relay.log 2>&1 <<'PY' &
import socket, sys, threading
P, Q, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", Q))
ls.listen(1)
node, _ = ls.accept()
coord = socket.create_connection(("127.0.0.1", P))
lock = threading.Lock()
state = {"up": True, "down": True, "round": False, "done": False}
def pump(src, dst, way):
    while True:
        data = src.recv(65536)
        if not data:
            break
        with lock:
            if way == "down" and b"round 0" in data:
                state["round"] = True
            if mode == "drop" and way == "up" and state["round"] and not state["done"]:
                state["done"] = True  # this chunk of node 1's lines is left out
                print("dropped", flush=True)
                continue
            dst.sendall(data)
            state[way] = data.endswith(b"\n")
            if mode == "inject" and state["round"] and not state["done"] and state["up"] and state["down"]:
                coord.sendall(b"failed 0 137 worker 1 killed by a relay\n")
                node.sendall(b"stop 0\n")
                state["done"] = True
                print("injected", flush=True)
    try:
        dst.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
t = threading.Thread(target=pump, args=(node, coord, "up"))
t.start()
pump(coord, node, "down")
t.join()
PY
relay=$!
flags="--nnodes 2 --max-restarts 1 --join-timeout 8 --nproc-per-node 1"
timeout 60 $R $flags --master-port $P --node-rank 0 /bin/sleep 6 > $D/n0.log 2>&1 &
n0=$!
sleep 0.3
timeout 60 $R $flags --master-port $Q --node-rank 1 /bin/sleep 6 > $D/n1.log 2>&1 &
n1=$!
wait $n0; echo "rc0=$?"
wait $n1; echo "rc1=$?"
kill $relay 2>/dev/null
cat $D/relay.log $D/n0.log $D/n1.log
)sh");
}

}  // namespace

TEST_CASE("launcher attack: a relay between the launchers can pass lines, not make them") {
  // Both refuse the relay's lines by their MAC, and the job ends as an
  // unattacked one does.
  test::RunResult r = relay_job("inject");
  INFO(r.output);
  CHECK(r.output.find("injected") != std::string::npos);
  expect_untouched(r);
  CHECK(r.output.find("ignored 1 line(s) from node 1 that did not carry this session's MAC") !=
        std::string::npos);
  CHECK(r.output.find("ignored 1 line(s) from node 0's launcher that did not carry this "
                      "session's MAC") != std::string::npos);
}

TEST_CASE("launcher attack: a relay that leaves out a line silences the node for good") {
  // Every later line of node 1's fails its MAC (its number is past what node
  // 0 expects), so node 0 hears nothing from it and, after 5 s, it is lost.
  test::RunResult r = relay_job("drop");
  INFO(r.output);
  CHECK(r.output.find("dropped") != std::string::npos);
  CHECK(r.output.find("node 1's launcher is gone (silent for 5 s)") != std::string::npos);
  CHECK(r.output.find("that did not carry this session's MAC") != std::string::npos);
}

TEST_CASE("launcher attack: a launcher that cannot prove the token gives no orders") {
  // Whoever answers at the master address without the token: the node asks
  // to join, finds the proof wrong, and ends without starting a worker.
  test::RunResult r = run_script(R"sh(
export TANDEM_TOKEN=the-real-token
python3 - "$P" > $D/fake.log 2>&1 <<'PY' &
import socket, sys
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", int(sys.argv[1])))
ls.listen(1)
c, _ = ls.accept()
f = c.makefile("rwb")
f.write(b"tandem-run 3 0123456789abcdef\n"); f.flush()
print("asked:", f.readline().decode().strip().split(" ")[0], flush=True)
f.write(b"admit " + b"ab" * 32 + b"\nround 0 0 2 1 4242\n"); f.flush()
print("answer:", f.readline().decode().strip(), flush=True)
PY
fake=$!
sleep 0.3
timeout 60 $R --nnodes 2 --node-rank 1 --master-port $P --max-restarts 1 --nproc-per-node 1 \
  /bin/echo started > $D/n1.log 2>&1
echo "rc1=$?"
wait $fake
cat $D/fake.log $D/n1.log
)sh");
  INFO(r.output);
  CHECK(value_of(r.output, "rc1") == 1);
  CHECK(r.output.find("asked: join") != std::string::npos);
  CHECK(r.output.find("answer: distrust its TANDEM_TOKEN differs from this node's") !=
        std::string::npos);
  CHECK(r.output.find("did not prove the cluster token, so it is not node 0's of this job") !=
        std::string::npos);
  CHECK(r.output.find("[0]: started") == std::string::npos);
  CHECK(r.output.find("starting 1 worker(s)") == std::string::npos);
}
