#pragma once
// Dropout's randomness under tensor parallelism: named generators every
// rank seeds from the job's seed (Megatron's generator tracker), and
// dropout that draws from one of them.
//
//   parallel::rng_tracker().seed(job_seed);                 // every process, once
//   at::Generator g = parallel::rng_tracker().get("block3");
//   y = parallel::dropout(x, 0.1, is_training(), g);         // a replicated region: the same mask on every rank
//   y = parallel::dropout_piece(p, 0.1, is_training(), g,    // a split one: this rank's piece of
//                               whole_shape, /*dim=*/1, start);  // the mask one process draws
//
// 1. get(name) is a CPU generator seeded from the tracker's seed and a
//    hash of the name, made on first use: the same on every rank that names
//    it, and the same in every process layout that runs the layer owning
//    it. A name that carries the rank ("block3/tp1") gives each rank its
//    own stream, as Megatron's model-parallel generator does.
// 2. dropout(x, p, train, g) is x * mask / (1 - p), mask ~ Bernoulli(1 - p)
//    drawn from g over x's shape (x itself when !train or p == 0).
//    dropout_piece draws the mask of the whole tensor (`whole`) and keeps
//    the piece x is (dimension `dim`, from `start`): in a split region, each
//    rank's mask is its piece of the one a single process draws, so every
//    split equals one process (for tp times the random numbers). Megatron
//    instead draws only the piece, from a generator of the rank's own:
//    cheaper, and different for every split.
// 3. states() / set_states() take and put back every generator's state
//    (activation recomputation does, so a recomputed forward draws the
//    forward's masks; a checkpoint may); set_states drops the generators
//    the states lack (made since: they are made anew, from the seed, when
//    next asked for). seed() drops every generator.
// 4. dropout's p outside [0, 1) is std::invalid_argument naming it.
// 5. KeepDefaultRng, a scope's guard: the default CPU generator's state is
//    put back when it ends (torch.random.fork_rng's way), so that what the
//    scope draws (building a module only for its shapes, or one whose
//    values are replaced at once) leaves the process's stream as it was.
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace tandem::parallel {

class RngTracker {
 public:
  void seed(uint64_t seed);
  uint64_t seed() const;
  at::Generator get(const std::string& name);
  std::map<std::string, at::Tensor> states() const;
  void set_states(const std::map<std::string, at::Tensor>& states);

 private:
  mutable std::mutex mu_;
  uint64_t seed_ = 0;
  std::map<std::string, at::Generator> generators_;
};

// The process's tracker.
RngTracker& rng_tracker();

class KeepDefaultRng {
 public:
  KeepDefaultRng();
  ~KeepDefaultRng();
  KeepDefaultRng(const KeepDefaultRng&) = delete;
  KeepDefaultRng& operator=(const KeepDefaultRng&) = delete;

 private:
  at::Tensor kept_;
};

at::Tensor dropout(const at::Tensor& x, double p, bool train, at::Generator g);
at::Tensor dropout_piece(const at::Tensor& x, double p, bool train, at::Generator g,
                         at::IntArrayRef whole, int64_t dim, int64_t start);

}  // namespace tandem::parallel
