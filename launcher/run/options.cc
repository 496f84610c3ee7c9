// The command line (launcher/run/options.h).
#include "launcher/run/options.h"

#include <algorithm>
#include <climits>
#include <optional>

namespace tandem::launcher {

namespace {

constexpr const char* kValueFlags[] = {
    "nproc-per-node", "nnodes",       "node-rank", "master-addr",  "master-port",
    "trace",          "max-restarts", "replace-failed", "last-call", "join-timeout",
    "peer-timeout",   "rdzv-endpoint", "rdzv-id", "local-addr",
};

int parse_int(const std::string& flag, const std::string& text, long long min, long long max) {
  std::string expected =
      "expected an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  std::string bad = "invalid value '" + text + "' for " + flag + " (" + expected + ")";
  if (text.empty()) throw UsageError(bad);
  long long value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') throw UsageError(bad);
    value = value * 10 + (c - '0');
    if (value > max) throw UsageError(bad);
  }
  if (value < min) throw UsageError(bad);
  return static_cast<int>(value);
}

// Accepts torchrun's underscore spelling too: --nproc_per_node is --nproc-per-node.
std::string normalize_flag(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

bool takes_value(const std::string& name) {
  for (const char* flag : kValueFlags) {
    if (name == flag) return true;
  }
  return false;
}

void apply_option(Options& options, const std::string& name, const std::string& value) {
  const std::string flag = "--" + name;
  if (name == "nproc-per-node") {
    options.nproc_per_node = parse_int(flag, value, 1, INT_MAX);
  } else if (name == "nnodes") {
    const size_t colon = value.find(':');
    if (colon == std::string::npos) {
      options.nnodes = options.min_nodes = parse_int(flag, value, 1, INT_MAX);
    } else {
      options.min_nodes = parse_int(flag + " (MIN of MIN:MAX)", value.substr(0, colon), 1, INT_MAX);
      options.nnodes = parse_int(flag + " (MAX of MIN:MAX)", value.substr(colon + 1), 1, INT_MAX);
      if (options.min_nodes > options.nnodes) {
        throw UsageError("--nnodes " + value + ": MIN is greater than MAX");
      }
    }
  } else if (name == "node-rank") {
    options.node_rank = parse_int(flag, value, 0, INT_MAX - 1);
    options.given_node_rank = true;
  } else if (name == "master-addr") {
    if (value.empty()) throw UsageError("--master-addr must not be empty");
    options.master_addr = value;
  } else if (name == "master-port") {
    options.master_port = parse_int(flag, value, 0, 65535);
  } else if (name == "max-restarts") {
    options.max_restarts = parse_int(flag, value, 0, 1000000);
  } else if (name == "replace-failed") {
    options.replace_failed = parse_int(flag, value, 0, 1000000);
  } else if (name == "last-call") {
    options.last_call_s = parse_int(flag, value, 0, 86400);
  } else if (name == "join-timeout") {
    options.join_timeout_s = parse_int(flag, value, 1, 86400 * 7);
  } else if (name == "peer-timeout") {
    options.peer_timeout_s = parse_int(flag, value, 0, 86400);
    if (options.peer_timeout_s == 1) {
      throw UsageError("--peer-timeout 1: 0 (never) or at least 2 seconds (peers send a "
                       "heartbeat a second)");
    }
  } else if (name == "rdzv-endpoint") {
    if (value.empty()) throw UsageError("--rdzv-endpoint must name etcd's members (host:port,...)");
    options.rdzv_endpoint = value;
  } else if (name == "rdzv-id") {
    if (value.empty() || value.find_first_of("/ \t\n") != std::string::npos) {
      throw UsageError("--rdzv-id '" + value + "': a non-empty word without '/'");
    }
    options.rdzv_id = value;
  } else if (name == "local-addr") {
    if (value.empty()) throw UsageError("--local-addr must not be empty");
    options.local_addr = value;
  } else if (name == "trace") {
    if (value.empty()) throw UsageError("--trace must name a directory");
    options.trace_dir = value;
  }
}

void validate(const Options& options) {
  if (options.nproc_per_node == 0) throw UsageError("missing required option --nproc-per-node");
  if (options.node_rank >= options.nnodes) {
    throw UsageError("--node-rank " + std::to_string(options.node_rank) +
                     " is out of range for --nnodes " + std::to_string(options.nnodes) +
                     " (expected 0 <= node-rank < nnodes)");
  }
  if (static_cast<long long>(options.nproc_per_node) * options.nnodes > INT_MAX) {
    throw UsageError("--nproc-per-node times --nnodes is too large");
  }
  if (!options.rdzv_endpoint.empty()) {
    // (the launchers meet in etcd; no node is special)
    if (options.given_node_rank) {
      throw UsageError("--node-rank with --rdzv-endpoint: the launchers number the nodes "
                       "themselves in etcd; leave it out on every node");
    }
    if (options.master_port != 0) {
      throw UsageError("--master-port with --rdzv-endpoint: the launchers meet in etcd, and "
                       "the coordinator they elect listens on a port of its own");
    }
    if (options.program.empty()) throw UsageError("missing PROGRAM to run");
    return;
  }
  if (!options.local_addr.empty() || options.rdzv_id != "job") {
    throw UsageError("--local-addr and --rdzv-id go with --rdzv-endpoint");
  }
  if (options.nnodes > 1 && options.master_port == 0) {
    throw UsageError("--master-port (non-zero) is required when --nnodes is greater than 1");
  }
  if (options.program.empty()) throw UsageError("missing PROGRAM to run");
  if (options.nnodes > 1 && options.node_rank < 0 &&
      (options.master_addr == "0.0.0.0" || options.master_addr == "::" ||
       options.master_addr == "[::]")) {
    throw UsageError("--node-rank left out with --master-addr " + options.master_addr +
                     ": every host could listen there, and each would be node 0; give node 0's "
                     "own address");
  }
  if (options.nnodes > 1 && options.node_rank < 0 && !coordinated(options)) {
    throw UsageError(
        "--node-rank is needed on every node of a job node 0's launcher does not coordinate "
        "(--nnodes " + std::to_string(options.nnodes) +
        " without --max-restarts): give each node its --node-rank, or pass --max-restarts N "
        "(or --nnodes MIN:MAX) on every node and node 0's launcher numbers them");
  }
}

}  // namespace

Options parse_args(int argc, char** argv) {
  Options options;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // PROGRAM: options end here
    if (arg == "--help" || arg == "-h") {
      options.help = true;
      return options;
    }
    if (arg.compare(0, 2, "--") != 0) throw UsageError("unknown option '" + arg + "'");
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    const size_t equals = name.find('=');
    if (equals != std::string::npos) {
      value = name.substr(equals + 1);
      name.resize(equals);
    }
    name = normalize_flag(name);
    if (!takes_value(name)) throw UsageError("unknown option '" + arg + "'");
    if (!value) {
      if (i + 1 >= argc) throw UsageError("option --" + name + " requires a value");
      value = argv[++i];
    }
    apply_option(options, name, *value);
  }
  options.program.assign(argv + i, argv + argc);
  validate(options);
  if (options.nnodes == 1 && options.node_rank < 0 && options.rdzv_endpoint.empty()) {
    options.node_rank = 0;
  }
  return options;
}

}  // namespace tandem::launcher
