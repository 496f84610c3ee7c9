// The communication hooks (ddp/distributed_data_parallel.h): how a bucket is
// averaged, called by the Reducer (ddp/reducer/buckets.cc) for each bucket.
#include <torch/version.h>

#include <stdexcept>
#include <string>

#include "tandem/ddp/distributed_data_parallel.h"

namespace tandem::ddp {
namespace {

CommHook compress_hook(at::ScalarType wire) {
  return [wire](ProcessGroup& group, at::Tensor& bucket) {
    if (!at::isFloatingType(bucket.scalar_type())) {
      throw std::invalid_argument(
          std::string("DistributedDataParallel: a compression hook takes ") +
          "floating-point buckets, not " + c10::toString(bucket.scalar_type()));
    }
    at::Tensor packed = bucket.div(group.size()).to(wire);
    BucketWork w;
    w.pending = group.all_reduce_async(packed, ReduceOp::kSum);
    w.finish = [bucket, packed]() mutable { bucket.copy_(packed); };
    return w;
  };
}

}  // namespace

CommHook allreduce_hook() {
  return [](ProcessGroup& group, at::Tensor& bucket) {
    bucket.div_(group.size());
    return BucketWork{group.all_reduce_async(bucket, ReduceOp::kSum), nullptr};
  };
}
CommHook fp16_compress_hook() { return compress_hook(at::kHalf); }
CommHook bf16_compress_hook() {
  CommHook inner = compress_hook(at::kBFloat16);
  return [inner](ProcessGroup& group, at::Tensor& bucket) {
#if TORCH_VERSION_MAJOR < 2
    if (group.backend() == "gloo") {
      throw std::invalid_argument(
          "bf16_compress_hook: Gloo in LibTorch 1.x cannot sum bfloat16 (LibTorch 2.x's can, "
          "and so can nccl); use fp16_compress_hook");
    }
#endif
    return inner(group, bucket);
  };
}

}  // namespace tandem::ddp
