#include "tandem/optim/options.h"

namespace tandem::optim {

std::string kind_name(Kind kind) {
  switch (kind) {
    case Kind::kSGD:
      return "SGD";
    case Kind::kAdam:
      return "Adam";
    case Kind::kAdamW:
      return "AdamW";
    case Kind::kAdagrad:
      return "Adagrad";
    case Kind::kRMSprop:
      return "RMSprop";
  }
  return "unknown";
}

std::optional<Kind> kind_from_number(int64_t number) {
  // The enumerators are numbered from 0 without gaps, kRMSprop last.
  if (number < 0 || number > static_cast<int64_t>(Kind::kRMSprop)) return std::nullopt;
  return static_cast<Kind>(number);
}

}  // namespace tandem::optim
