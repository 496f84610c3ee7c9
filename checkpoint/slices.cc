// Tensors and optimizer states whole or in flat slices (checkpoint/slices.h).
#include "tandem/checkpoint/slices.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/StringUtil.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cctype>
#include <stdexcept>

namespace tandem::checkpoint {

namespace {

// "123" -> 123; -1 for anything else.
int64_t number(const std::string& s) {
  if (s.empty() || s.size() > 18) return -1;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
  }
  return std::stoll(s);
}

}  // namespace

std::string slice_name(const std::string& name, int64_t start, int64_t end) {
  return name + "#" + std::to_string(start) + ":" + std::to_string(end);
}
std::string shape_name(const std::string& name) { return name + "#shape"; }
std::string alias_name(const std::string& name) { return name + "#alias"; }

std::string shape_text(at::IntArrayRef shape) {
  std::string s;
  for (int64_t d : shape) s += (s.empty() ? "" : " ") + std::to_string(d);
  return s;
}

Slices::Slices(const Reader& reader) : reader_(reader) {
  for (const std::string& entry : reader.names()) {
    const size_t hash = entry.rfind('#');
    if (hash == std::string::npos) continue;
    const size_t colon = entry.find(':', hash);
    if (colon == std::string::npos) continue;
    const int64_t start = number(entry.substr(hash + 1, colon - hash - 1));
    const int64_t end = number(entry.substr(colon + 1));
    if (start < 0 || end < start) continue;  // not a slice's name
    slices_[entry.substr(0, hash)].push_back({start, end, entry});
  }
  for (auto& [name, list] : slices_) {
    std::sort(list.begin(), list.end(),
              [](const Slice& x, const Slice& y) { return x.start < y.start; });
  }
}

std::string Slices::resolve(const std::string& name) const {
  if (reader_.contains(name) || slices_.count(name) || !reader_.contains(alias_name(name))) {
    return name;
  }
  return reader_.bytes(alias_name(name));
}

const std::vector<Slices::Slice>* Slices::slices_of(const std::string& name) const {
  auto it = slices_.find(name);
  return it == slices_.end() ? nullptr : &it->second;
}

bool Slices::contains(const std::string& name) const {
  const std::string n = resolve(name);
  return reader_.contains(n) || slices_of(n) != nullptr;
}

std::string Slices::coverage_problem(const std::string& name, at::IntArrayRef shape,
                                     bool tensors) const {
  const std::vector<Slice>* list = slices_of(name);
  if (!list) return "the step holds no '" + name + "'";
  if (reader_.contains(shape_name(name))) {
    reader_.check(shape_name(name));
    const std::string saved = reader_.bytes(shape_name(name));
    if (saved != shape_text(shape)) {
      std::string dims = saved;
      for (size_t i = dims.find(' '); i != std::string::npos; i = dims.find(' ', i + 2)) {
        dims.replace(i, 1, ", ");
      }
      return "'" + name + "' is [" + dims + "] in the step, " + c10::str(shape) + " here";
    }
  }
  const int64_t numel = c10::multiply_integers(shape);
  int64_t at = 0;
  for (const Slice& s : *list) {
    if (s.start > at) {
      return "'" + name + "': its elements [" + std::to_string(at) + ", " +
             std::to_string(s.start) + ") are in no slice";
    }
    if (s.start < at) return "'" + s.entry + "' overlaps the slice before it";
    if (tensors) {
      const std::vector<int64_t> got = reader_.shape(s.entry);
      if (got != std::vector<int64_t>{s.end - s.start}) {
        return "'" + s.entry + "' is " + c10::str(at::IntArrayRef(got)) + ", not [" +
               std::to_string(s.end - s.start) + "]";
      }
    }
    at = s.end;
  }
  if (at != numel) {
    return "'" + name + "' has " + std::to_string(at) + " elements in its slices, " +
           std::to_string(numel) + " here";
  }
  for (const Slice& s : *list) reader_.check(s.entry);
  return "";
}

std::string Slices::tensor_problem(const std::string& name, at::IntArrayRef shape) const {
  const std::string n = resolve(name);
  if (!reader_.contains(n) && !slices_of(n) && c10::multiply_integers(shape) == 0) return "";
  try {
    if (reader_.contains(n)) {
      const std::vector<int64_t> saved = reader_.shape(n);
      if (!shape.equals(saved)) {
        return "'" + n + "' is " + c10::str(at::IntArrayRef(saved)) + " in the step, " +
               c10::str(shape) + " here";
      }
      reader_.check(n);
      return "";
    }
    return coverage_problem(n, shape, true);
  } catch (const std::invalid_argument& e) {
    return e.what();  // (a part that fails its checks)
  }
}

std::string Slices::state_problem(const std::string& name, at::IntArrayRef shape) const {
  const std::string n = resolve(name);
  if (!reader_.contains(n) && !slices_of(n) && c10::multiply_integers(shape) == 0) return "";
  try {
    if (reader_.contains(n)) {
      reader_.check(n);
      return "";
    }
    return coverage_problem(n, shape, false);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
}

at::Tensor Slices::tensor(const std::string& name, at::IntArrayRef shape, int64_t a,
                          int64_t b) const {
  if (const std::string p = tensor_problem(name, shape); !p.empty()) {
    throw std::invalid_argument("checkpoint: " + p);
  }
  const std::string n = resolve(name);
  if (reader_.contains(n)) return reader_.tensor(n).reshape({-1}).narrow(0, a, b - a);
  if (!slices_of(n)) return at::empty({0});  // (no elements to hold)
  std::vector<at::Tensor> parts;
  for (const Slice& s : *slices_of(n)) {
    const int64_t lo = std::max(a, s.start), hi = std::min(b, s.end);
    if (lo >= hi) continue;
    parts.push_back(reader_.tensor(s.entry).narrow(0, lo - s.start, hi - lo));
  }
  if (parts.empty()) return reader_.tensor(slices_of(n)->front().entry).narrow(0, 0, 0);
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

at::Tensor Slices::tensor(const std::string& name, at::IntArrayRef shape) const {
  return tensor(name, shape, 0, c10::multiply_integers(shape)).view(shape);
}

void Slices::state_pieces(const std::string& name, at::IntArrayRef shape, int64_t a, int64_t b,
                          int64_t to, std::vector<optim::StatePiece>& out) const {
  if (const std::string p = state_problem(name, shape); !p.empty()) {
    throw std::invalid_argument("checkpoint: " + p);
  }
  const std::string n = resolve(name);
  if (reader_.contains(n)) {
    out.push_back({reader_.bytes(n), c10::multiply_integers(shape), a, to, b - a, n});
    return;
  }
  if (!slices_of(n)) return;  // (no elements)
  for (const Slice& s : *slices_of(n)) {
    const int64_t lo = std::max(a, s.start), hi = std::min(b, s.end);
    if (lo >= hi) continue;
    out.push_back(
        {reader_.bytes(s.entry), s.end - s.start, lo - s.start, to + (lo - a), hi - lo, s.entry});
  }
}

std::string Slices::state(optim::Kind kind, const std::string& name, at::IntArrayRef shape) const {
  const std::string n = resolve(name);
  if (reader_.contains(n)) return reader_.bytes(n);
  std::vector<optim::StatePiece> pieces;
  const int64_t count = c10::multiply_integers(shape);
  state_pieces(n, shape, 0, count, 0, pieces);
  return optim::join_param_states(kind, shape, pieces);
}

}  // namespace tandem::checkpoint
