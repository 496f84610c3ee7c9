// gpt: a small decoder-only transformer trained at character level, cut into
// pipeline stages, split tensor-parallel and replicated data-parallel over
// a mesh (pp x dp x tp): the
// main job, what `./dev demo` runs (2 x 2 on 4 local processes).
//
//   build/bin/tandem-run --nproc-per-node 4 build/bin/gpt [--pp 2 --dp 2] [--schedule 1f1b]
//       [--chunks 4] [--steps 300] [--batch 32] [--corpus FILE] [--checkpoint gpt.ckpt]
//       [--resume] [--losses gpt_losses.csv] ...
//   build/bin/gpt --pp 2 --dp 2        (started alone, it starts its pp x dp workers itself)
//
// The mesh (tandem::Mesh, {{"pp", pp}, {"dp", dp}}) puts rank pp_index * dp +
// dp_index at stage pp_index of replica dp_index. Replica d's driver is the
// rank at (0, d): it builds its replica's stages from the model's layer
// specs (examples/gpt/model.h: embeddings, `--layers` transformer blocks, a
// head), cut by pipeline::partition where rank 0 measured the layers' times
// (pipeline::balance_by_time), on the workers at (s, d); runs each step's
// `--batch / --dp` sequences through its pipe in `--chunks` micro-batches by
// `--schedule`; and steps them with one Adam DistributedOptimizer, clipped
// to a global norm of `--clip`, under a cosine schedule with `--warmup`
// steps of warm-up (with --zero 1, each stage's Adam state is sharded over
// its replicas: DistributedOptions::shard_group; --zero 2 and 3 train the
// whole model on every rank instead, data_parallel.cc). The pipes average
// each stage's gradients over its
// replicas (PipeOptions::data_parallel_group = the mesh's dp group), so
// every replica's stage s holds the same parameters throughout. The other
// ranks only serve their stages.
//
// --tp N splits each stage's layers over N tensor-parallel ranks (mesh
// {{"pp", pp}, {"dp", dp}, {"tp", tp}}): each tp rank's driver at (0, d, t)
// runs a pipe of its own over the stage workers at (s, d, t), built from
// the tp layer specs (model.h: the vocabulary split in the embedding, the
// head and the loss, each block a parallel::ParallelBlock); the tp pipes
// run the same schedule on the same batches, so a stage's tp ranks meet in
// their collectives, and clipping sums the norm over the tp drivers.
// --sequence-parallel runs the regions between the split layers on each tp
// rank's piece of the sequence (Megatron's sequence parallelism; the
// replicated parameters' partial gradients summed in backward).
// With --zero 2 or 3 (--pp 1), each tp rank's replicas shard its split of
// the model over dp (ZeRO 2, or FSDP a unit a block), as Megatron-Core's
// distributed optimizer and torchtitan's FSDP x TP do.
// --recompute recomputes each block's activations in backward (in the
// pipeline's stages and in --zero 2's and 3's units); --dropout P draws
// each block's masks from its layer's generator (parallel/random.h), the
// same under any --tp and --pp. A --tp
// job's checkpoints hold each split parameter as slices of the whole one,
// so they resume under any other --tp, --pp, --dp or --zero, and back.
//
// Determinism: the initial parameters come from at::manual_seed(--seed),
// the batches from a DistributedSampler seeded with it (step s's global
// batch is the same set of windows whatever the layout), and the schedule
// is a function of the step, so 2 x 2, 1 x 2, 2 x 1 and 1 x 1 follow the
// same losses (to float rounding) and --resume continues exactly (the last
// line's loss is printed with %.6f to compare). The checkpoint's format is
// in examples/gpt/checkpoint.h.
//
// --ft trains pp x dp (and pp x tp x dp) under tandem::ft::Manager instead
// of over a mesh: each pipeline row, with its tensor-parallel ranks, is a
// replica that a failure takes out of the quorum and a heal from another
// row brings back (fault_tolerant.cc; run it under tandem-run
// --replace-failed N).
//
// The text is, by default, every regular file in /usr/share/common-licenses
// (the demo runs on any Debian machine); --corpus takes any other file.
#include <ATen/ops/tensor.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>

#include "examples/gpt/checkpoint.h"
#include "examples/gpt/config.h"
#include "examples/gpt/model.h"
#include "examples/gpt/train.h"
#include "examples/launch.h"
#include "examples/text.h"
#include "tandem/ddp/process_group.h"
#include "tandem/ft/manager.h"
#include "tandem/mesh/mesh.h"
#include "tandem/parallel/random.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rendezvous.h"

namespace gpt {
namespace {

namespace rpc = tandem::rpc;

void add_flags(examples::Flags& flags, Config& cfg) {
  flags.add("--pp", &cfg.pp, 1, "pipeline stages (workers per replica)")
      .add("--dp", &cfg.dp, 0,
           "data-parallel replicas; 0: the world's size over --pp, so that an elastic job "
           "(tandem-run --nnodes MIN:MAX) keeps the global --batch on fewer workers")
      .add("--tp", &cfg.tp, 1,
           "tensor-parallel ranks a stage's layers are split over (heads, MLP, vocabulary)")
      .add_switch("--sequence-parallel", &cfg.sequence_parallel,
                  "with --tp: the LayerNorms, dropout and residual sums between the split layers "
                  "on each rank's piece of the sequence (--context must divide by --tp)")
      .add_switch("--recompute", &cfg.recompute,
                  "drop each block's activations after forward and make them again in backward")
      .add("--dropout", &cfg.dropout,
           "dropout on each block's attention probabilities and residual branches (0: none); "
           "the same masks under any --tp and --pp with the same --chunks")
      .add_choice("--schedule", &cfg.schedule, {"gpipe", "1f1b", "zero-bubble", "interleaved"},
                  "the pipeline schedule (interleaved: two stages a worker)")
      .add("--chunks", &cfg.chunks, 1, "micro-batches per replica and step")
      .add("--layers", &cfg.layers, 1, "transformer blocks")
      .add("--dim", &cfg.dim, 1, "model width")
      .add("--heads", &cfg.heads, 1, "attention heads (dividing --dim)")
      .add("--context", &cfg.context, 2, "characters a sequence holds")
      .add("--steps", &cfg.steps, 1, "total training steps (the schedule's length)")
      .add("--stop-at", &cfg.stop_at, 0,
           "stop after this step with a checkpoint, as if interrupted (0: --steps)")
      .add("--batch", &cfg.batch, 1, "sequences per step, over all replicas")
      .add("--lr", &cfg.lr, "Adam's peak learning rate")
      .add("--warmup", &cfg.warmup, 1, "steps of linear warm-up")
      .add("--clip", &cfg.clip, "the global gradient norm")
      .add("--seed", &cfg.seed, 0, "seed of the initial parameters, the batches and the sample")
      .add("--log-every", &cfg.log_every, 1, "print the mean loss every N steps")
      .add("--corpus", &cfg.corpus, "text to train on (default: /usr/share/common-licenses/*)")
      .add("--losses", &cfg.losses, "also write each progress line to this CSV file")
      .add("--checkpoint", &cfg.checkpoint,
           "checkpoint directory (one folder a step, the last two kept)")
      .add("--checkpoint-every", &cfg.checkpoint_every, 1, "save a checkpoint every N steps")
      .add_switch("--checkpoint-sync", &cfg.checkpoint_sync,
                  "write checkpoints in the step (default: in the background)")
      .add_switch("--resume", &cfg.resume,
                  "continue from --checkpoint's newest step up to --steps (a restarted job "
                  "does: tandem-run --max-restarts, torchrun)")
      .add("--sample", &cfg.sample, 0, "characters generated at the end")
      .add("--zero", &cfg.zero, 0,
           "ZeRO: 1 shards each stage's Adam state over its replicas; 2 (--pp 1) also the "
           "gradients, under DDP; 3 (--pp 1) everything, by FSDP with a unit a block; 0 none")
      .add("--peer-timeout", &cfg.peer_timeout, 0,
           "seconds a worker may send nothing before it counts as stalled (stopped, frozen) and "
           "the job fails, for --max-restarts to restart it; 0: never (default: "
           "$TANDEM_PEER_TIMEOUT, which tandem-run --peer-timeout sets, else 30)")
      .add_switch(
          "--strict-resume", &cfg.strict_resume,
          "refuse a damaged newest checkpoint instead of going back to the newest whole one");
  examples::add_nonfinite_flags(flags, &cfg.on_nonfinite, &cfg.nan_at, "a token");
  flags
      .add_switch("--ft", &cfg.ft,
                  "each pipeline row a replica under ft::Manager, training on through a "
                  "failure (run under tandem-run --replace-failed N; float64)")
      .add("--min-replicas", &cfg.min_replicas, 1,
           "with --ft, the fewest rows a quorum trains with (fewer: the job restarts from its "
           "checkpoint under tandem-run --max-restarts)")
      .add("--reference", &cfg.reference,
           "with --ft, K1,K2,...: train in this process as a --ft run whose committed steps "
           "had these quorums, and print its final line");
}

// What is wrong with the flags for a job of `world` processes, or "".
std::string check(Config& cfg, int world) {
  const int64_t row = cfg.pp * cfg.tp;  // the ranks of one replica
  if (cfg.dp == 0) {
    if (world < 1) {
      cfg.dp = 1;  // started alone: spawns pp x tp workers
    } else if (world % row != 0) {
      return "--dp 0: a world of " + std::to_string(world) + " processes does not divide into " +
             std::to_string(cfg.pp) + "-stage pipelines (--pp) of " + std::to_string(cfg.tp) +
             " tensor-parallel ranks (--tp)";
    } else {
      cfg.dp = world / row;
    }
  }
  const std::string layout = std::to_string(cfg.pp) + " x " + std::to_string(cfg.dp) +
                             (cfg.tp > 1 ? " x " + std::to_string(cfg.tp) : "");
  if (world >= 1 && row * cfg.dp != world) {
    return "--pp " + std::to_string(cfg.pp) + " --dp " + std::to_string(cfg.dp) +
           (cfg.tp > 1 ? " --tp " + std::to_string(cfg.tp) : "") + " needs " +
           std::to_string(row * cfg.dp) + " processes, not " + std::to_string(world) +
           " (tandem-run --nproc-per-node " + std::to_string(row * cfg.dp) + ")";
  }
  if (cfg.tp > 1 && cfg.heads % cfg.tp != 0) {
    return "--tp " + std::to_string(cfg.tp) + " does not divide --heads " +
           std::to_string(cfg.heads) + ": each tensor-parallel rank takes whole heads";
  }
  if (cfg.sequence_parallel && cfg.tp < 2) {
    return "--sequence-parallel splits the sequence over tensor-parallel ranks: pass --tp 2 or "
           "more";
  }
  if (cfg.sequence_parallel && cfg.context % cfg.tp != 0) {
    return "--sequence-parallel: --context " + std::to_string(cfg.context) +
           " does not split into " + std::to_string(cfg.tp) + " equal pieces (--tp)";
  }
  if (!(cfg.dropout >= 0 && cfg.dropout < 1)) {
    return "--dropout " + std::to_string(cfg.dropout) + " is not a probability in [0, 1)";
  }
  if (cfg.batch % cfg.dp != 0) {
    return "--batch " + std::to_string(cfg.batch) + " does not divide among " +
           std::to_string(cfg.dp) + " replicas";
  }
  if (cfg.batch / cfg.dp < cfg.chunks) {
    return "each replica's " + std::to_string(cfg.batch / cfg.dp) + " sequences cannot make " +
           std::to_string(cfg.chunks) + " micro-batches (--chunks)";
  }
  if (cfg.peer_timeout == 1) {
    return "--peer-timeout 1: 0 (never) or at least 2 seconds (peers send a heartbeat a second)";
  }
  if (cfg.zero < 0 || cfg.zero > 3) {
    return "--zero " + std::to_string(cfg.zero) + " is not a ZeRO stage (0, 1, 2 or 3)";
  }
  if (cfg.zero >= 2 && cfg.pp != 1) {
    return "--zero " + std::to_string(cfg.zero) +
           " trains the whole model on every rank: pass --pp 1 (--zero 1 shards a pipeline's)";
  }
  if (cfg.ft && (cfg.zero != 0 || cfg.schedule == "interleaved" || cfg.dropout != 0 ||
                 cfg.nan_at != 0 || cfg.resume || cfg.stop_at != 0)) {
    return "--ft runs rows of one stage (or one tensor-parallel rank's split of one) a rank: it "
           "takes no --zero, --schedule interleaved, --dropout, --nan-at, --resume or --stop-at";
  }
  if (!cfg.reference.empty() && !cfg.ft) return "--reference goes with --ft";
  if (cfg.min_replicas != 1 && !cfg.ft) return "--min-replicas goes with --ft";
  if (cfg.ft && (cfg.min_replicas < 1 || cfg.min_replicas > cfg.dp)) {
    return "--min-replicas " + std::to_string(cfg.min_replicas) + " is not between 1 and --dp " +
           std::to_string(cfg.dp);
  }
  if (cfg.stop_at > cfg.steps) {
    return "--stop-at " + std::to_string(cfg.stop_at) + " is past --steps " +
           std::to_string(cfg.steps);
  }
  if (cfg.dim % cfg.heads != 0) {
    return "--heads " + std::to_string(cfg.heads) + " does not divide --dim " +
           std::to_string(cfg.dim);
  }
  if (cfg.layers + 2 < stage_count(cfg)) {
    return "a " + layout + " job (" + cfg.schedule + ") has " + std::to_string(stage_count(cfg)) +
           " stages, more than the model's " + std::to_string(cfg.layers + 2) + " layers";
  }
  return "";
}

// The newest checkpoint in --checkpoint, checked against the text and the
// flags; nullopt when there is none.
std::optional<Checkpoint> checked_resume(const Config& cfg, const examples::Corpus& corpus) {
  std::optional<Checkpoint> found = load_latest(cfg.checkpoint, cfg.strict_resume);
  if (!found) return std::nullopt;
  Checkpoint& ck = *found;
  const std::string what =
      "checkpoint '" + tandem::checkpoint::step_path(cfg.checkpoint, ck.step) + "'";
  if (ck.corpus_fnv != corpus.fingerprint || ck.vocab != corpus.vocab) {
    throw UsageError(what + " was trained on another text; pass the same --corpus");
  }
  if (ck.seed != cfg.seed) {
    throw UsageError(what + " was trained with --seed " + std::to_string(ck.seed));
  }
  const std::vector<int64_t> shape = {cfg.layers, cfg.dim, cfg.heads, cfg.context};
  if (ck.shape != shape) {
    throw UsageError(what + " holds another model (--layers, --dim, --heads, --context " +
                     std::to_string(ck.shape.at(0)) + " " + std::to_string(ck.shape.at(1)) + " " +
                     std::to_string(ck.shape.at(2)) + " " + std::to_string(ck.shape.at(3)) + ")");
  }
  // The pipeline's steps, --zero 2's and --zero 3's hold the same names
  // (checkpoint.h): each resumes the others'.
  if (ck.mode != "pipeline" && ck.mode != "zero2" && ck.mode != "zero3") {
    throw UsageError(what + " was written in a mode this gpt does not know ('" + ck.mode + "')");
  }
  int64_t layers = 0;
  for (int64_t c : ck.counts) layers += c;
  if (layers != cfg.layers + 2) {
    throw UsageError(what + " holds " + std::to_string(layers) + " layers in " +
                     std::to_string(ck.counts.size()) + " stages: not a checkpoint of this model");
  }
  if (ck.step >= cfg.steps && tandem::checkpoint::restart_count() == 0) {
    throw UsageError(what + " is at step " + std::to_string(ck.step) + "; pass a larger --steps");
  }
  return found;
}

// Each rank chose its step on its own, verifying what it read: a file read
// differently on two ranks (a transient I/O error) must not leave them
// loading different steps. Collective over the mesh.
void agree_on_resume(tandem::Mesh& mesh, const std::optional<Checkpoint>& resume) {
  const double step = resume ? static_cast<double>(resume->step) : -1.0;
  at::Tensor highest = at::tensor({step, -step}, at::kDouble);  // the max, and minus the min
  for (const auto& dim : mesh.dims())
    mesh.group(dim)->all_reduce(highest, tandem::ddp::ReduceOp::kMax);
  const auto top = static_cast<long long>(highest[0].item<double>());
  const auto bottom = static_cast<long long>(-highest[1].item<double>());
  if (top != bottom) {
    throw std::runtime_error("the ranks found different newest whole checkpoints (steps " +
                             std::to_string(bottom) + " and " + std::to_string(top) +
                             ", -1 for none): a file reads differently on some of them");
  }
}

int job_main(int argc, char** argv) {
  const Clock::time_point started = Clock::now();
  try {
    const rpc::WorldEnv env = rpc::world_from_env();
    Config cfg;
    examples::Flags flags("gpt");
    add_flags(flags, cfg);
    std::string error = flags.parse(argc, argv);
    if (error.empty()) error = check(cfg, env.world_size);
    std::optional<examples::Corpus> corpus;
    std::optional<Checkpoint> resume;
    if (error.empty() && !flags.help()) {
      try {
        corpus = examples::load_corpus(cfg.corpus, cfg.context + 1 + cfg.batch);
        // --resume, or a restart of the job (its checkpoints are where to go
        // on from; none yet: it starts from the beginning again).
        const int round = tandem::checkpoint::restart_count();
        if (cfg.ft) {
          // (its own checkpoints, read by fault_tolerant.cc; a fresh job's
          // first process of rank 0 clears an older run's)
          const char* replaced = std::getenv("TANDEM_REPLACEMENT_COUNT");
          const bool first = round == 0 && (!replaced || std::strcmp(replaced, "0") == 0);
          if (first && env.rank == 0 && cfg.checkpoint_every > 0 && cfg.reference.empty()) {
            refuse_foreign(cfg.checkpoint);
            tandem::checkpoint::remove_steps(cfg.checkpoint);
          }
        } else if (cfg.resume || round > 0) {
          resume = checked_resume(cfg, *corpus);
          if (!resume && cfg.resume) {
            throw UsageError("--resume: no checkpoint in '" + cfg.checkpoint + "'");
          }
          if (resume && resume->step >= cfg.steps) {
            // A restart after the last step was saved (a worker failed at the
            // end): the training is done.
            if (env.rank == 0) {
              std::printf("gpt: restart %d: the checkpoint is at step %lld, the last: done\n",
                          round, static_cast<long long>(resume->step));
            }
            return 0;
          }
          if (env.rank == 0 && round > 0) {
            std::printf("gpt: restart %d: %s\n", round,
                        resume ? ("from step " + std::to_string(resume->step)).c_str()
                               : "no checkpoint yet, from the beginning");
            std::fflush(stdout);
          }
        } else if (env.rank == 0) {
          // A fresh run: an older run's steps in the directory must not be
          // taken for this one's after a restart.
          refuse_foreign(cfg.checkpoint);
          if (const int n = tandem::checkpoint::remove_steps(cfg.checkpoint)) {
            std::printf("gpt: a fresh run: removed %d older checkpoint(s) from %s\n", n,
                        cfg.checkpoint.c_str());
          }
        }
      } catch (const UsageError& e) {
        error = e.what();
      }
    }
    if (cfg.ft && !flags.help()) {
      if (!error.empty()) {
        if (env.rank <= 0)
          std::fprintf(stderr, "gpt: %s\n%s", error.c_str(), flags.usage().c_str());
        return 2;
      }
      try {
        return cfg.reference.empty() ? drive_fault_tolerant(cfg, *corpus)
                                     : ft_reference(cfg, *corpus);
      } catch (const tandem::ft::QuorumError& e) {
        std::fprintf(stderr, "gpt: %s\n", e.what());
        return tandem::ft::kExitNotReplaceable;  // the job's failure: not replaced alone
      }
    }
    if (env.rank < 0) {
      return examples::outside_world(
          flags, error,
          "start me with pp x dp workers: build/bin/tandem-run --nproc-per-node 4 "
          "build/bin/gpt --pp 2 --dp 2");
    }
    // Every rank joins the world, even with nothing to train, so that the
    // others' shutdown returns.
    enable_poisoning(cfg.nan_at > 0);
    rpc::AgentOptions agent_options;
    if (cfg.peer_timeout >= 0) agent_options.peer_timeout = std::chrono::seconds(cfg.peer_timeout);
    rpc::init(std::make_shared<rpc::Registry>(), agent_options);
    std::optional<tandem::Mesh> mesh;
    const int rc = examples::run_worker(flags, error, /*speak=*/env.rank == 0, [&] {
      tandem::MeshOptions mo;
      mo.timeout = std::chrono::minutes(2);  // a stuck collective fails loudly
      mesh.emplace(tandem::Mesh::Shape{{"pp", static_cast<int>(cfg.pp)},
                                       {"dp", static_cast<int>(cfg.dp)},
                                       {"tp", static_cast<int>(cfg.tp)}},
                   mo);
      agree_on_resume(*mesh, resume);
      // Dropout's generators (model.h): from the seed, and each replica
      // its own masks (its own rows).
      tandem::parallel::rng_tracker().seed(static_cast<uint64_t>(cfg.seed) * 1000003u +
                                           static_cast<uint64_t>(mesh->coordinate("dp")));
      if (mesh->coordinate("pp") != 0) return 0;  // serves its stages until the drivers are done
      const Job job{cfg, *corpus, resume, *mesh, started};
      return cfg.zero >= 2 ? drive_data_parallel(job) : drive(job);
    });
    // A failed worker leaves at once (the launcher ends the others): a
    // graceful shutdown would wait for replicas stuck on its averages. Its
    // groups go first, while the agent can still say which peer is stalled
    // (their closing would otherwise wait for it).
    if (rc != 0 && mesh) {
      for (const auto& dim : mesh->dims()) mesh->group(dim)->abandon();
      mesh.reset();
    }
    rpc::shutdown(rc == 0);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt: %s\n", e.what());
    return 1;
  }
}

}  // namespace
}  // namespace gpt

int main(int argc, char** argv) {
  // examples/launch.h: under tandem-run, or started alone with pp x dp workers.
  long pp = 2, dp = 2, tp = 1;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--pp") == 0) pp = std::strtol(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--dp") == 0) dp = std::strtol(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--tp") == 0) tp = std::strtol(argv[i + 1], nullptr, 10);
  }
  if (dp == 0) dp = 1;  // --dp 0: the world's size, which alone is pp x tp
  const int nprocs =
      pp >= 1 && dp >= 1 && tp >= 1 && pp * dp * tp <= 256 ? static_cast<int>(pp * dp * tp) : 1;
  // (--reference trains in this process alone)
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--reference", 11) == 0) return gpt::job_main(argc, argv);
  }
  return examples::launch("gpt", nprocs, argc, argv, gpt::job_main);
}
