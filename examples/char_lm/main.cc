// char_lm: a character-level language model trained across two workers
// (what `./dev demo` runs).
//
//   build/bin/tandem-run --nproc-per-node 2 build/bin/char_lm [--steps 400] [--corpus FILE]
//       [--checkpoint char_lm.ckpt] [--checkpoint-every 100] [--resume] [--seed 0] [--lr 0.006]
//   build/bin/tandem-run --nproc-per-node 3 build/bin/char_lm --mode hybrid [...]
//   build/bin/tandem-run --nproc-per-node 2 build/bin/char_lm --mode pipeline [...]
//
// The last worker (worker1 of two) is a parameter server: it only serves. worker0 trains
//   Embedding(V, 32) -> LSTM(32, 128) -> Linear(128, V) -> cross-entropy
// where the embedding and the decoder are RemoteModules living on worker1 and
// the LSTM is an ordinary torch::nn::LSTM on the trainer. Every step runs in a
// distributed autograd context: the forward hops trainer -> worker1 ->
// trainer -> worker1, backward() comes back through both, and one
// DistributedOptimizer (Adam) over the remote modules' parameters and the
// LSTM's clips the global gradient norm and steps every owner at once.
//
// --mode hybrid (data and model parallelism together) runs N - 1 trainers on
// N processes, sharing the parameter server's embedding and decoder (worker0
// makes them and hands their references to the others). Each trainer's LSTM
// is wrapped in DistributedDataParallel over a process group of the
// trainers, so every backward averages the LSTM's gradients among them
// while the remote modules' gradients go to the server; each trainer steps
// the shared modules with its own optimizer, as in PyTorch's DDP + RPC
// tutorial, but never while another trainer's forward or backward uses
// them (the trainers meet before and after stepping). Gradients are not
// clipped in this mode (see the training loop). Trainer r trains on the batches of steps s * (N -
// 1) + r, so the trainers read different text. The shared modules take the trainers' steps in no
// fixed order, so a hybrid run is not reproducible to the bit and writes no checkpoint (--resume is
// refused); at the end the trainers check that their LSTMs are identical.
//
// The text is, by default, every regular file in /usr/share/common-licenses
// (sorted by name; the symbolic links there only repeat other files), so the
// demo runs on any Debian machine; --corpus takes any other file. The
// vocabulary is the distinct bytes of the text.
//
// --mode pipeline trains the same model as a pipeline (pipeline/pipe.h) of
// two stages: Embedding + LSTM on worker0, the decoder on worker1; each
// batch goes through in 4 micro-batches by the 1F1B schedule, the stages'
// gradients land in the distributed autograd context and one
// DistributedOptimizer (Adam, clipped) steps both. It starts from the same
// parameters and batches as single mode, so its losses follow single
// mode's (to float rounding). It writes no checkpoint; the sample feeds the
// last 64 characters through the pipe for each new one.
//
// Determinism: step s trains on a batch drawn from a generator seeded by
// (seed, s) alone, and the initial parameters come from at::manual_seed(seed)
// on the trainer (the remote modules get theirs with load_state_dict), so a
// run resumed from a checkpoint prints exactly the losses of an uninterrupted
// one (the last line's loss is printed with %.6f to compare).
//
// The checkpoints' format is in examples/char_lm/checkpoint.h.
//
// training; the trainer still joins the world and shuts down so that the
// parameter server exits too, then exits with code 2.
#include <ATen/CPUGeneratorImpl.h>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>

#include "examples/char_lm/checkpoint.h"
#include "examples/char_lm/config.h"
#include "examples/char_lm/corpus.h"
#include "examples/char_lm/train.h"
#include "examples/flags.h"
#include "examples/launch.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rendezvous.h"

namespace char_lm {
namespace {

namespace rpc = tandem::rpc;

int job_main(int argc, char** argv) {
  const Clock::time_point started = Clock::now();
  try {
    const rpc::WorldEnv env = rpc::world_from_env();
    if (env.world_size >= 2 && env.rank == env.world_size - 1) {
      // The parameter server: serves the remote modules (and its part of
      // the optimizers) until the trainers are done. It reads no flags.
      rpc::init(std::make_shared<rpc::Registry>());
      rpc::shutdown();
      return 0;
    }

    Config cfg;
    examples::Flags flags("char_lm");
    flags.add("--steps", &cfg.steps, 1, "total training steps")
        .add("--corpus", &cfg.corpus,
             "text file to train on (default: /usr/share/common-licenses/*)")
        .add("--checkpoint", &cfg.checkpoint, "directory of checkpoint steps")
        .add("--checkpoint-every", &cfg.checkpoint_every, 1, "write the checkpoint every N steps")
        .add_switch("--resume", &cfg.resume, "continue from --checkpoint up to --steps")
        .add("--seed", &cfg.seed, 0, "seed of the initial parameters, batches and sample")
        .add("--lr", &cfg.lr, "Adam's learning rate")
        .add("--log-every", &cfg.log_every, 1, "print the mean loss every N steps")
        .add("--losses", &cfg.losses, "also write each progress line to this CSV file")
        .add_choice("--mode", &cfg.mode, {"single", "hybrid", "pipeline"},
                    "one trainer (2 processes); N - 1 DDP trainers sharing the parameter "
                    "server (N >= 3 processes); or the model pipelined over 2 processes")
        .add_choice("--schedule", &cfg.schedule, {"gpipe", "1f1b", "zero-bubble"},
                    "--mode pipeline's schedule");
    examples::add_nonfinite_flags(flags, &cfg.on_nonfinite, &cfg.nan_at, "a target");
    std::string error = flags.parse(argc, argv);
    const Place at{env.rank, env.world_size - 1};
    if (error.empty() && env.world_size >= 2) {
      if (cfg.hybrid() && at.trainers < 2) {
        error =
            "--mode hybrid needs 3 or more processes (trainers and a parameter server): "
            "tandem-run --nproc-per-node 3";
      } else if (!cfg.hybrid() && at.trainers > 1) {
        error = "--mode " + cfg.mode + " runs on 2 processes; pass --mode hybrid for " +
                std::to_string(at.trainers) + " data-parallel trainers";
      } else if (cfg.hybrid() && cfg.resume) {
        error =
            "--resume is for --mode single: hybrid trainers step the shared modules in no "
            "fixed order, so a hybrid run writes no checkpoint";
      } else if (!cfg.pipeline() && cfg.schedule != "1f1b") {
        error = "--schedule is for --mode pipeline";
      } else if (cfg.pipeline() && cfg.resume) {
        error = "--resume is for --mode single: a pipeline run writes no checkpoint";
      }
    }
    std::optional<Corpus> corpus;
    std::optional<Checkpoint> resume;
    if (error.empty() && !flags.help()) {
      try {
        corpus = load_corpus(cfg.corpus);
        // --resume, or a restart of the job: the newest complete step (none
        // yet after a restart: from the beginning again).
        const bool single = !cfg.hybrid() && !cfg.pipeline();
        if (single && (cfg.resume || tandem::checkpoint::restart_count() > 0)) {
          resume = load_latest(cfg.checkpoint);
          if (!resume && cfg.resume) {
            throw UsageError("--resume: no checkpoint in '" + cfg.checkpoint + "'");
          }
        } else if (single && env.rank == 0) {
          // A fresh run: an older run's steps must not be taken for this one's.
          load_latest(cfg.checkpoint);  // (refuses a file there, or another program's steps)
          if (const int n = tandem::checkpoint::remove_steps(cfg.checkpoint)) {
            std::printf("char_lm: a fresh run: removed %d older checkpoint(s) from %s\n", n,
                        cfg.checkpoint.c_str());
          }
        }
        if (resume) {
          const std::string what = "checkpoint '" + resume->path + "'";
          if (resume->corpus_fnv != corpus->fingerprint) {
            throw UsageError(what + " was trained on another corpus; pass the same --corpus");
          }
          if (resume->seed != cfg.seed) {
            throw UsageError(what + " was trained with --seed " + std::to_string(resume->seed));
          }
          if (resume->step >= cfg.steps && tandem::checkpoint::restart_count() == 0) {
            throw UsageError(what + " is at step " + std::to_string(resume->step) +
                             "; pass a larger --steps");
          }
        }
      } catch (const UsageError& e) {
        error = e.what();
      }
    }
    if (env.rank < 0 || env.world_size < 2) {
      return examples::outside_world(
          flags, error,
          "start me with 2 workers: build/bin/tandem-run --nproc-per-node 2 "
          "build/bin/char_lm");
    }

    // Join the world even when there is nothing to train, so that the
    // parameter server's shutdown() returns and it exits on its own.
    Shared shared;
    auto registry = std::make_shared<rpc::Registry>();
    registry->def("shared_module", [&shared](int64_t which) {
      std::lock_guard<std::mutex> lock(shared.mu);
      auto& promise = which == 0 ? shared.embedding : shared.decoder;
      if (!promise) throw std::logic_error("the shared modules were handed out already");
      return promise->future();
    });
    rpc::init(registry);
    const int rc = examples::run_worker(flags, error, /*speak=*/at.rank == 0, [&] {
      if (cfg.pipeline()) return train_pipeline(cfg, *corpus, started, at);
      return train(cfg, *corpus, resume, started, at, shared);
    });
    // A failed worker leaves at once (the launcher ends the others): a
    // graceful shutdown would wait on a peer that may be the cause.
    rpc::shutdown(rc == 0);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "char_lm: %s\n", e.what());
    return 1;
  }
}

}  // namespace
}  // namespace char_lm

int main(int argc, char** argv) {
  // examples/launch.h: under tandem-run, or started alone. --mode hybrid is
  // a job of 3 (two trainers and the parameter server); the others of 2.
  int nprocs = 2;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--mode") == 0 && std::strcmp(argv[i + 1], "hybrid") == 0) nprocs = 3;
  }
  return examples::launch("char_lm", nprocs, argc, argv, char_lm::job_main);
}
