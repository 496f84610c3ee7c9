// autograd_bench: distributed backward over a chain of RPC hops, like
// bench/anchors/dist_backward.py (PyTorch's side).
//
// Two processes on loopback: this one is worker0 and starts itself again as
// worker1. worker0 holds x (64 floats, requires grad); each hop is
// rpc_sync("worker1", "add", y, 1) inside a distributed autograd context; the
// loss is y.sum(). It times backward() alone, and the forward with and
// without a context (the cost of recording, per RPC). Each figure is the
// median over --rounds fresh process pairs of the per-round p50.
//
// Prints, per hop count H:
//   {"bench":"dist_backward","impl":"tandem","hops":H,"p50_us":..,"record_us_per_rpc":..}
// record_us_per_rpc is the anchor's measure (forward with a context minus
// without, per hop); on a small VM it moves by tens of microseconds with
// thread wake-ups. So it also prints the recording itself, measured in one
// process with no network: a request and its response through encode and
// decode with the autograd hooks, minus without them, per RPC:
//   {"bench":"dist_record","impl":"tandem","p50_us":..}
//
// Usage: autograd_bench [--hops 1,4,16] [--iters 200] [--rounds 5]
#include <ATen/ops/add.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/ones.h>

#include <chrono>
#include <cstdio>
#include <cstring>

#include "bench/bench_util.h"
#include "tandem/autograd/autograd.h"
#include "tandem/autograd/dist_autograd.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/wire/wire.h"
#include "tests/support/local_job.h"

namespace {

namespace rpc = tandem::rpc;
namespace dist = tandem::autograd;
namespace support = tandem::support;
using Clock = std::chrono::steady_clock;
using tandem::bench::median;
using tandem::bench::percentile;

std::shared_ptr<rpc::Registry> registry() {
  auto reg = std::make_shared<rpc::Registry>();
  reg->def("add", [](at::Tensor y, double s) { return at::add(y, s); });
  return reg;
}

rpc::AgentOptions options(int rank) {
  rpc::AgentOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.num_worker_threads = 4;
  return o;
}

at::Tensor forward(rpc::Agent& agent, at::Tensor x, int hops) {
  at::Tensor y = x;
  for (int i = 0; i < hops; ++i) y = agent.rpc_sync<at::Tensor>("worker1", "add", y, 1.0);
  return y;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The frame's bytes through a receiver's decoder.
rpc::Message roundtrip(const rpc::OutFrame& f) {
  std::string bytes = f.to_bytes();
  rpc::FrameDecoder d{rpc::Limits{}};
  d.feed(bytes.data(), bytes.size());
  return d.take();
}

struct Figures {
  double backward_p50 = 0;  // seconds
  double record_per_rpc = 0;
};

std::string g_transport;  // what carried the calls: "tcp" or "shm"

std::vector<Figures> round_trip(const std::vector<int>& hop_counts, int iters) {
  pid_t child = tandem::bench::spawn_peer("callee");
  auto agent = rpc::init(registry(), options(0));
  g_transport = tandem::bench::transport_to(*agent, "worker1");
  at::Tensor x = at::ones({64}).requires_grad_();
  std::vector<Figures> out;
  for (int hops : hop_counts) {
    std::vector<double> back, fwd_ctx, fwd_plain;
    for (int i = 0; i < iters + 5; ++i) {
      // Alternate which forward goes first, so neither always follows the
      // previous iteration's context release.
      double plain = 0, with_ctx = 0, backward = 0;
      auto plain_forward = [&] {
        auto t0 = Clock::now();
        forward(*agent, x.detach(), hops);
        plain = seconds_since(t0);
      };
      if (i % 2 == 0) plain_forward();
      {
        dist::Context ctx(*agent);
        auto t0 = Clock::now();
        at::Tensor loss = forward(*agent, x, hops).sum();
        with_ctx = seconds_since(t0);
        t0 = Clock::now();
        dist::backward(ctx.id(), {loss});
        backward = seconds_since(t0);
        if (!at::allclose(dist::get_gradients(ctx.id()).at(x), at::ones({64}))) {
          throw std::runtime_error("wrong gradient");
        }
      }
      if (i % 2 == 1) plain_forward();
      if (i >= 5) {
        back.push_back(backward);
        fwd_ctx.push_back(with_ctx);
        fwd_plain.push_back(plain);
      }
    }
    out.push_back(
        {percentile(back, 0.5), (percentile(fwd_ctx, 0.5) - percentile(fwd_plain, 0.5)) / hops});
  }
  rpc::shutdown(true);
  support::wait_exit(child);
  return out;
}

// One RPC's messages (request x -> response x + 1) through the codec, with
// or without the hooks; returns seconds per RPC (p50).
double codec_round(rpc::Agent& agent, const at::Tensor& x, bool record, int iters) {
  auto hooks = dist::DistAutograd::of(agent);
  std::vector<double> lat;
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    rpc::Message req;
    req.kind = rpc::MessageKind::kRequest;
    req.id = 1;
    req.callee = "add";
    req.values = {x, 1.0};
    if (record) hooks->before_send(req, 0);
    rpc::OutFrame out = rpc::encode(req);
    if (record) hooks->after_encode(req, out, 0);
    rpc::Message got = roundtrip(out);
    if (record) hooks->after_receive(got, 0);
    at::Tensor y = at::add(got.values[0].toTensor(), 1.0);
    rpc::Message resp;
    resp.kind = rpc::MessageKind::kResponse;
    resp.id = 1;
    resp.values = {y};
    resp.autograd_context = got.autograd_context;
    if (record) hooks->before_send(resp, 0);
    rpc::OutFrame back = rpc::encode(resp);
    if (record) hooks->after_encode(resp, back, 0);
    rpc::Message result = roundtrip(back);
    if (record) hooks->after_receive(result, 0);
    lat.push_back(seconds_since(t0));
  }
  return percentile(lat, 0.5);
}

// The recording cost per RPC, in one process (world of one, no network).
double record_cost(int iters) {
  rpc::AgentOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.init_method = "tcp://127.0.0.1:0";
  auto agent = rpc::Agent::create(o, registry());
  double cost;
  {
    at::Tensor x = at::ones({64}).requires_grad_();
    dist::Context ctx(*agent);
    at::Tensor y = at::add(x, 2.0);  // a little graph below the sent tensor
    codec_round(*agent, y, true, 100);
    codec_round(*agent, y.detach(), false, 100);
    double with = codec_round(*agent, y, true, iters);
    double without = codec_round(*agent, y.detach(), false, iters);
    cost = with - without;
  }
  agent->shutdown();
  return cost;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (const char* role = std::getenv("TANDEM_BENCH_ROLE")) {
      unsetenv("TANDEM_BENCH_ROLE");
      if (std::strcmp(role, "callee") != 0) return 2;
      rpc::init(registry(), options(1));
      rpc::shutdown(true);
      return 0;
    }
    std::vector<int64_t> hops = {1, 4, 16};
    int iters = 200, rounds = 5;
    tandem::bench::Flags flags("autograd_bench");
    flags.add("--hops", &hops, 1).add("--iters", &iters, 1).add("--rounds", &rounds, 1);
    if (!flags.parse(argc, argv)) return 2;
    std::vector<int> hop_counts(hops.begin(), hops.end());
    std::vector<std::vector<double>> back(hop_counts.size()), record(hop_counts.size());
    for (int r = 0; r < rounds; ++r) {
      auto figures = round_trip(hop_counts, iters);
      for (size_t i = 0; i < hop_counts.size(); ++i) {
        back[i].push_back(figures[i].backward_p50);
        record[i].push_back(figures[i].record_per_rpc);
      }
    }
    for (size_t i = 0; i < hop_counts.size(); ++i) {
      std::printf(
          "{\"bench\":\"dist_backward\",\"impl\":\"tandem\",\"transport\":\"%s\",\"hops\":%d,"
          "\"p50_us\":%.1f,\"record_us_per_rpc\":%.1f,\"rounds\":%d}\n",
          g_transport.c_str(), hop_counts[i], median(back[i]) * 1e6, median(record[i]) * 1e6,
          rounds);
      std::fflush(stdout);
    }
    std::printf("{\"bench\":\"dist_record\",\"impl\":\"tandem\",\"p50_us\":%.2f}\n",
                record_cost(20000) * 1e6);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "autograd_bench: %s\n", e.what());
    return 1;
  }
}
