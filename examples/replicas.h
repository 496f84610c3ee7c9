// The data-parallel examples' closing check: every rank holds rank 0's values.
#pragma once

#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>

#include <vector>

#include "tandem/ddp/process_group.h"

namespace examples {

// Whether `tensors` are equal to rank 0's on every rank of `group`
// (collective: every rank calls it, with the same tensors' shapes).
inline bool same_on_every_rank(const std::vector<at::Tensor>& tensors,
                               tandem::ddp::ProcessGroup& group) {
  bool same = true;
  for (const auto& t : tensors) {
    at::Tensor first = t.detach().clone();
    group.broadcast(first, 0);
    same = same && at::equal(first, t.detach());
  }
  // An nccl group takes CUDA tensors: the verdict goes where the values are.
  at::Tensor all = at::full({1}, same ? 1 : 0, at::kInt);
  if (!tensors.empty()) all = all.to(tensors[0].device());
  group.all_reduce(all, tandem::ddp::ReduceOp::kMin);
  return all.item<int>() == 1;
}

}  // namespace examples
