// Command-line flags for the example programs: `--name value` and bare
// switches (`--resume`), each bound to a variable that holds its default.
//
//   int64_t steps = 600;
//   std::string corpus;
//   bool resume = false;
//   examples::Flags flags("char_lm");
//   flags.add("--steps", &steps, 1, "total training steps")
//        .add("--corpus", &corpus, "text file to train on")
//        .add_switch("--resume", &resume, "continue from --checkpoint");
//   std::string error = flags.parse(argc, argv);   // "" when all is well
//
// parse() returns the problem as one line instead of exiting, because a
// distributed program must still let its peers go before it exits (see
// examples/char_lm/main.cc). --help and -h set help(); usage() is the text
// to print then.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace examples {

class Flags {
 public:
  explicit Flags(std::string program) : program_(std::move(program)) {}

  // An integer of at least `min`.
  Flags& add(const std::string& name, int64_t* value, int64_t min, const std::string& help) {
    return add_flag(name, std::to_string(*value), help, "N", [=](const std::string& s) {
      size_t used = 0;
      const int64_t v = std::stoll(s, &used);
      if (used != s.size()) throw std::invalid_argument("not an integer");
      if (v < min) throw std::invalid_argument("must be at least " + std::to_string(min));
      *value = v;
    });
  }

  // A finite number above 0.
  Flags& add(const std::string& name, double* value, const std::string& help) {
    std::ostringstream def;
    def << *value;
    return add_flag(name, def.str(), help, "X", [=](const std::string& s) {
      size_t used = 0;
      const double v = std::stod(s, &used);
      if (used != s.size()) throw std::invalid_argument("not a number");
      if (!(v > 0) || v > std::numeric_limits<double>::max()) {
        throw std::invalid_argument("must be a positive number");
      }
      *value = v;
    });
  }

  // Any non-empty string (a path, say).
  Flags& add(const std::string& name, std::string* value, const std::string& help) {
    return add_flag(name, value->empty() ? "" : *value, help, "PATH", [=](const std::string& s) {
      if (s.empty()) throw std::invalid_argument("must not be empty");
      *value = s;
    });
  }

  // One of `choices` (the metavar lists them: "single|hybrid").
  Flags& add_choice(const std::string& name, std::string* value, std::vector<std::string> choices,
                    const std::string& help) {
    std::string metavar;
    for (const auto& c : choices) metavar += (metavar.empty() ? "" : "|") + c;
    return add_flag(name, *value, help, metavar, [=](const std::string& s) {
      if (std::find(choices.begin(), choices.end(), s) == choices.end()) {
        throw std::invalid_argument(metavar);
      }
      *value = s;
    });
  }

  // A switch without a value: present means true.
  Flags& add_switch(const std::string& name, bool* value, const std::string& help) {
    flags_.push_back({name, "", help, "", [=](const std::string&) { *value = true; }, false});
    return *this;
  }

  // Sets the variables from argv; returns "" or what is wrong, in one line.
  std::string parse(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      const std::string name = argv[i];
      if (name == "--help" || name == "-h") {
        help_ = true;
        continue;
      }
      const Flag* f = nullptr;
      for (const auto& x : flags_) {
        if (x.name == name) f = &x;
      }
      if (f == nullptr) return "unknown flag '" + name + "' (" + program_ + " --help lists them)";
      if (!f->takes_value) {
        f->set("");
        continue;
      }
      if (i + 1 == argc) return name + " needs a value";
      const std::string value = argv[++i];
      try {
        f->set(value);
      } catch (const std::exception& e) {
        // std::stoll's own messages ("stoll") say nothing useful.
        const std::string why = e.what();
        return "bad value '" + value + "' for " + name +
               (why.rfind("sto", 0) == 0 ? std::string() : ": " + why);
      }
    }
    return "";
  }

  bool help() const { return help_; }
  const std::string& program() const { return program_; }

  std::string usage() const {
    std::string out = "usage: " + program_ + " [flags]\n";
    for (const auto& f : flags_) {
      std::string left = "  " + f.name + (f.takes_value ? " " + f.metavar : "");
      left.resize(std::max<size_t>(left.size() + 2, 26), ' ');
      out += left + f.help;
      if (f.takes_value && !f.default_value.empty()) out += " (default " + f.default_value + ")";
      out += "\n";
    }
    return out;
  }

 private:
  struct Flag {
    std::string name;
    std::string default_value;
    std::string help;
    std::string metavar;
    std::function<void(const std::string&)> set;
    bool takes_value = true;
  };

  Flags& add_flag(const std::string& name, std::string def, const std::string& help,
                  const std::string& metavar, std::function<void(const std::string&)> set) {
    flags_.push_back({name, std::move(def), help, metavar, std::move(set), true});
    return *this;
  }

  std::string program_;
  std::vector<Flag> flags_;
  bool help_ = false;
};

// A failure the user can fix (a bad flag, file or checkpoint): exit code 2,
// its message alone.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A program started outside a world (not by tandem-run): --help prints the
// usage (0); otherwise the flag error, or `how_to_start`, and 2.
inline int outside_world(const Flags& flags, const std::string& error,
                         const std::string& how_to_start) {
  if (flags.help()) {
    std::printf("%s", flags.usage().c_str());
    return 0;
  }
  std::fprintf(stderr, "%s: %s\n", flags.program().c_str(),
               error.empty() ? how_to_start.c_str() : error.c_str());
  return 2;
}

// A worker's part once it has joined the world (it joins even on a bad
// flag, so that its peers' shutdown() returns): --help prints the usage (0),
// a flag error is printed (2); otherwise run()'s exit code, 2 for a
// UsageError it throws and 1 for any other exception. Only a worker with
// `speak` prints the usage and the flag error (one line per job, not per worker).
inline int run_worker(const Flags& flags, const std::string& error, bool speak,
                      const std::function<int()>& run) {
  if (flags.help()) {
    if (speak) std::printf("%s", flags.usage().c_str());
    return 0;
  }
  if (!error.empty()) {
    if (speak) std::fprintf(stderr, "%s: %s\n", flags.program().c_str(), error.c_str());
    return 2;
  }
  try {
    return run();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\n", flags.program().c_str(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", flags.program().c_str(), e.what());
    return 1;
  }
}

// --on-nonfinite stop|skip and --nan-at N, as gpt and char_lm take them
// (tandem/optim/nonfinite.h); `poisoned` says what --nan-at poisons.
inline Flags& add_nonfinite_flags(Flags& flags, std::string* policy, int64_t* nan_at,
                                  const std::string& poisoned) {
  return flags
      .add_choice("--on-nonfinite", policy, {"stop", "skip"},
                  "a step whose loss or gradient norm is not finite: stop the job naming it, or "
                  "skip its update (counted)")
      .add("--nan-at", nan_at, 0,
           "testing: poison " + poisoned +
               " of step N's batch, so that its loss and gradients are NaN (0: never)");
}

}  // namespace examples
