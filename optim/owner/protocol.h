// The messages between a DistributedOptimizer (the caller) and the owners'
// service (the workers that own its parameters).
//
// What it promises: each message is a struct with one encoder (the call's
// arguments, or the answer, as IValues) and one decoder that checks every
// field a peer sent: a wrong count or type, an unknown kind, a flag other
// than 0 or 1, a number where none is allowed (a NaN or negative rate, a
// context 0, a clipping factor outside [0, 1), a gradient norm that is not
// one non-negative number) is an error naming the function (or the owner,
// for an answer) and the field; nothing is read out of range. Errors are
// std::invalid_argument, but for an answer of the right type with wrong
// contents, std::runtime_error (a broken peer, not a bad argument). What
// the decoders do not check is checked once where it is used, for the
// caller's own part (which never travels) as for the others: an optimizer
// id the owner does not hold (the service names it), option values
// LibTorch refuses (make_optimizer), an archive that cannot be read (the
// service's load).
// Its neighbours: optim/distributed_optimizer.cc encodes requests and
// decodes answers; optim/owner/service.cc registers the functions below,
// decodes requests and encodes answers. The IValues on the wire are those
// the functions took before they were named here.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/optim/options.h"
#include "tandem/rpc/rref.h"

namespace tandem::optim::owner {

// The functions the owners' service registers.
inline constexpr char kCreate[] = "tandem.optim.create";
inline constexpr char kStep[] = "tandem.optim.step";
inline constexpr char kDestroy[] = "tandem.optim.destroy";
inline constexpr char kSetLr[] = "tandem.optim.set_lr";
inline constexpr char kGradNorms[] = "tandem.optim.grad_norms";
inline constexpr char kScaleGrads[] = "tandem.optim.scale_grads";
inline constexpr char kState[] = "tandem.optim.state";
inline constexpr char kLoad[] = "tandem.optim.load";

// tandem.optim.create: make optimizer `id`, of `kind` with `options`, over
// `params` (owned by the receiver, at least one); with a `shard_group`
// (non-empty), its state sharded over the process group of that name
// registered on the receiver (ZeRO stage 1). On the wire: (int id, int
// kind, 13 floats, RRef list, str shard_group); the floats are Options'
// fields in the order protocol.cc lists them, a flag as 0 or 1.
struct CreateRequest {
  int64_t id = 0;
  Kind kind = Kind::kSGD;
  Options options;
  std::vector<rpc::RRef<at::Tensor>> params;
  std::string shard_group;

  std::vector<c10::IValue> encode() const;
  static CreateRequest decode(const std::vector<c10::IValue>& args);
};

// tandem.optim.step: step optimizer `id` with its gradients in autograd
// context `context_id` (never 0). On the wire: (int id, int context).
struct StepRequest {
  int64_t id = 0;
  uint64_t context_id = 0;

  std::vector<c10::IValue> encode() const;
  static StepRequest decode(const std::vector<c10::IValue>& args);
};

// tandem.optim.destroy and tandem.optim.state: optimizer `id` alone. On the
// wire: (int id).
struct IdRequest {
  int64_t id = 0;

  std::vector<c10::IValue> encode() const;
  // `function` names the message in errors (kDestroy or kState).
  static IdRequest decode(const std::vector<c10::IValue>& args, const char* function);
};

// tandem.optim.set_lr: the learning rate (finite, >= 0) of every param
// group of optimizer `id`. On the wire: (int id, float lr).
struct SetLrRequest {
  int64_t id = 0;
  double lr = 0;

  std::vector<c10::IValue> encode() const;
  static SetLrRequest decode(const std::vector<c10::IValue>& args);
};

// tandem.optim.grad_norms: the norm_type-norm (>= 0 or infinity) of each of
// optimizer `id`'s gradients in context `context_id` (never 0). On the
// wire: (int id, int context, float norm_type).
struct GradNormsRequest {
  int64_t id = 0;
  uint64_t context_id = 0;
  double norm_type = 2;

  std::vector<c10::IValue> encode() const;
  static GradNormsRequest decode(const std::vector<c10::IValue>& args);
};

// Its answer: per parameter of the optimizer, in its order, the norm of
// its gradient (a 0-dim floating-point CPU tensor, never negative; NaN and
// infinity are let through, as clip_grad_norm_ lets them through), or
// None when it has no gradient in the context. On the wire: a list of
// optional tensors.
struct GradNormsReply {
  std::vector<c10::optional<at::Tensor>> norms;

  c10::IValue encode() const;
  // `from` names the owner; it must have sent one entry per parameter of
  // its `num_params`.
  static GradNormsReply decode(const c10::IValue& answer, size_t num_params,
                               const std::string& from);
};

// tandem.optim.scale_grads: multiply optimizer `id`'s gradients in context
// `context_id` (never 0) by `coef`, in [0, 1) (the caller sends no factor
// of 1 or more). On the wire: (int id, int context, float coef).
struct ScaleGradsRequest {
  int64_t id = 0;
  uint64_t context_id = 0;
  double coef = 0;

  std::vector<c10::IValue> encode() const;
  static ScaleGradsRequest decode(const std::vector<c10::IValue>& args);
};

// tandem.optim.state's answer: the owner's LibTorch archive of its
// optimizer (opaque here). On the wire: a string.
struct StateReply {
  std::string bytes;

  c10::IValue encode() const;
  static StateReply decode(const c10::IValue& answer, const std::string& from);
};

// tandem.optim.load: replace optimizer `id`'s state by the archive `bytes`
// (one a StateReply carried) and set its learning rate to `lr` (finite,
// >= 0). On the wire: (int id, str bytes, float lr).
struct LoadRequest {
  int64_t id = 0;
  std::string bytes;
  double lr = 0;

  std::vector<c10::IValue> encode() const;
  static LoadRequest decode(const std::vector<c10::IValue>& args);
};

}  // namespace tandem::optim::owner
