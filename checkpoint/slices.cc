// Tensors and optimizer states whole or in flat slices (checkpoint/slices.h).
#include "tandem/checkpoint/slices.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/StringUtil.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cctype>
#include <functional>
#include <set>
#include <sstream>
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

std::vector<PieceCut> piece_cuts(const std::string& name, const at::Tensor& t,
                                 std::string* shape_record) {
  shape_record->clear();
  if (replica_of(t) > 0) return {};  // (copy 0 writes it)
  const std::optional<Placement> p = placement_of(t);
  if (!p) return {{name, 0, -1}};
  std::vector<PieceCut> out;
  for (const PieceEntry& e : piece_entries(*p)) out.push_back({name + e.suffix, e.piece_start, e.numel});
  if (p->ranges.front().first == 0) *shape_record = shape_text(p->whole);
  return out;
}

void add_tensor(Part& part, const std::string& name, const at::Tensor& t) {
  std::string shape;
  const at::Tensor flat = t.detach().contiguous().reshape({-1});
  for (const PieceCut& c : piece_cuts(name, t, &shape)) {
    if (c.numel < 0) {
      part.add(c.entry, t);
    } else {
      part.add(c.entry, flat.narrow(0, c.start, c.numel));
    }
  }
  if (!shape.empty()) part.add_bytes(shape_name(name), shape);
}

Slices::Slices(const Reader& reader) : reader_(reader) {
  for (const std::string& entry : reader.names()) {
    const size_t hash = entry.rfind('#');
    if (hash == std::string::npos) continue;
    const size_t colon = entry.find(':', hash);
    if (colon == std::string::npos) continue;
    if (entry[hash + 1] == 'd') {  // a block: "#d<dim>:<start>:<end>[@<lo>:<hi>]"
      const size_t second = entry.find(':', colon + 1);
      if (second == std::string::npos) continue;
      const size_t at = entry.find('@', second);
      const int64_t dim = number(entry.substr(hash + 2, colon - hash - 2));
      const int64_t a = number(entry.substr(colon + 1, second - colon - 1));
      const int64_t b = number(entry.substr(second + 1, at == std::string::npos ? at : at - second - 1));
      int64_t lo = 0, hi = -1;  // (the whole block)
      if (at != std::string::npos) {
        const size_t third = entry.find(':', at);
        if (third == std::string::npos) continue;
        lo = number(entry.substr(at + 1, third - at - 1));
        hi = number(entry.substr(third + 1));
        if (lo < 0 || hi <= lo) continue;
      }
      if (dim < 1 || a < 0 || b <= a) continue;
      add_block(entry.substr(0, hash), entry, dim, a, b, lo, hi);
      continue;
    }
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

void Slices::add_block(const std::string& name, const std::string& entry, int64_t dim, int64_t a,
                       int64_t b, int64_t lo, int64_t hi) {
  // The whole shape, from the record beside it (without one, or with a
  // dimension it lacks, the block stands for nothing and the name's
  // coverage says what is missing).
  if (!reader_.contains(shape_name(name))) return;
  std::vector<int64_t> whole;
  {
    std::istringstream in(reader_.bytes(shape_name(name)));
    for (long long d; in >> d;) whole.push_back(d);
  }
  if (dim >= static_cast<int64_t>(whole.size()) || b > whole[static_cast<size_t>(dim)]) return;
  Placement p{whole, dim, {{a, b}}};
  const int64_t block = piece_entries(p).front().numel;
  if (hi < 0) hi = block;
  if (hi > block) return;  // (more than the block holds: stands for nothing)
  int64_t offset = 0;
  for (const auto& [start, end] : flat_ranges(p, lo, hi)) {
    slices_[name].push_back({start, end, entry, offset, hi - lo});
    offset += end - start;
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
      if (got != std::vector<int64_t>{s.numel()}) {
        return "'" + s.entry + "' is " + c10::str(at::IntArrayRef(got)) + ", not [" +
               std::to_string(s.numel()) + "]";
      }
    }
    at = s.end;
  }
  if (at != numel) {
    return "'" + name + "' has " + std::to_string(at) + " elements in its slices, " +
           std::to_string(numel) + " here";
  }
  std::set<std::string> checked;  // (a block's rows share their entry)
  for (const Slice& s : *list) {
    if (checked.insert(s.entry).second) reader_.check(s.entry);
  }
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

void Slices::overlapping(const std::vector<Slice>& list, int64_t a, int64_t b,
                         const std::function<void(const Slice&, int64_t, int64_t)>& fn) {
  // (from the last slice starting at or before a: they are sorted by start)
  auto it = std::upper_bound(list.begin(), list.end(), a,
                             [](int64_t x, const Slice& s) { return x < s.start; });
  if (it != list.begin()) --it;
  for (; it != list.end() && it->start < b; ++it) {
    const int64_t lo = std::max(a, it->start), hi = std::min(b, it->end);
    if (lo < hi) fn(*it, lo, hi);
  }
}

at::Tensor Slices::read_range(const std::string& n, int64_t a, int64_t b, Cache& cache) const {
  auto entry = [&](const std::string& e) -> const at::Tensor& {
    auto it = cache.tensors.find(e);
    if (it == cache.tensors.end()) it = cache.tensors.emplace(e, reader_.tensor(e).reshape({-1})).first;
    return it->second;
  };
  if (reader_.contains(n)) return entry(n).narrow(0, a, b - a);
  if (!slices_of(n)) return at::empty({0});  // (no elements to hold)
  std::vector<at::Tensor> parts;
  const auto& list = *slices_of(n);
  overlapping(list, a, b, [&](const Slice& s, int64_t lo, int64_t hi) {
    parts.push_back(entry(s.entry).narrow(0, s.offset + lo - s.start, hi - lo));
  });
  if (parts.empty()) return entry(list.front().entry).narrow(0, 0, 0);
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

at::Tensor Slices::tensor(const std::string& name, at::IntArrayRef shape, int64_t a,
                          int64_t b) const {
  if (const std::string p = tensor_problem(name, shape); !p.empty()) {
    throw std::invalid_argument("checkpoint: " + p);
  }
  Cache cache;
  return read_range(resolve(name), a, b, cache);
}

at::Tensor Slices::piece(const std::string& name, const Placement& p) const {
  if (const std::string problem = tensor_problem(name, p.whole); !problem.empty()) {
    throw std::invalid_argument("checkpoint: " + problem);
  }
  const std::string n = resolve(name);
  Cache cache;
  std::vector<at::Tensor> parts;
  for (const auto& [a, b] : flat_ranges(p)) parts.push_back(read_range(n, a, b, cache));
  if (parts.empty()) return at::empty(piece_shape(p));
  return (parts.size() == 1 ? parts[0] : at::cat(parts)).view(piece_shape(p));
}

at::Tensor Slices::piece(const std::string& name, const Placement& p, int64_t lo,
                         int64_t hi) const {
  if (const std::string problem = tensor_problem(name, p.whole); !problem.empty()) {
    throw std::invalid_argument("checkpoint: " + problem);
  }
  const std::string n = resolve(name);
  Cache cache;
  std::vector<at::Tensor> parts;
  for (const auto& [a, b] : flat_ranges(p, lo, hi)) parts.push_back(read_range(n, a, b, cache));
  if (parts.empty()) return at::empty({0});
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

void Slices::piece_state_pieces(const std::string& name, const Placement& p, int64_t lo,
                                int64_t hi, int64_t to, std::vector<optim::StatePiece>& out) const {
  if (const std::string problem = state_problem(name, p.whole); !problem.empty()) {
    throw std::invalid_argument("checkpoint: " + problem);
  }
  const std::string n = resolve(name);
  Cache cache;
  const int64_t count = c10::multiply_integers(p.whole);
  for (const auto& [a, b] : flat_ranges(p, lo, hi)) {
    pieces_range(n, count, a, b, to, out, cache);
    to += b - a;
  }
}

at::Tensor Slices::tensor(const std::string& name, at::IntArrayRef shape) const {
  return tensor(name, shape, 0, c10::multiply_integers(shape)).view(shape);
}

void Slices::pieces_range(const std::string& n, int64_t count, int64_t a, int64_t b, int64_t to,
                          std::vector<optim::StatePiece>& out, Cache& cache) const {
  auto bytes = [&](const std::string& e) {
    auto it = cache.bytes.find(e);
    if (it == cache.bytes.end()) {
      it = cache.bytes.emplace(e, std::make_shared<const std::string>(reader_.bytes(e))).first;
    }
    return it->second;
  };
  if (reader_.contains(n)) {
    out.push_back({bytes(n), count, a, to, b - a, n});
    return;
  }
  if (!slices_of(n)) return;  // (no elements)
  overlapping(*slices_of(n), a, b, [&](const Slice& s, int64_t lo, int64_t hi) {
    out.push_back(
        {bytes(s.entry), s.numel(), s.offset + lo - s.start, to + (lo - a), hi - lo, s.entry});
  });
}

void Slices::state_pieces(const std::string& name, at::IntArrayRef shape, int64_t a, int64_t b,
                          int64_t to, std::vector<optim::StatePiece>& out) const {
  if (const std::string p = state_problem(name, shape); !p.empty()) {
    throw std::invalid_argument("checkpoint: " + p);
  }
  Cache cache;
  pieces_range(resolve(name), c10::multiply_integers(shape), a, b, to, out, cache);
}

std::string Slices::piece_state(optim::Kind kind, const std::string& name,
                                const Placement& p) const {
  if (const std::string problem = state_problem(name, p.whole); !problem.empty()) {
    throw std::invalid_argument("checkpoint: " + problem);
  }
  const std::string n = resolve(name);
  Cache cache;
  std::vector<optim::StatePiece> pieces;
  const int64_t count = c10::multiply_integers(p.whole);
  int64_t to = 0;
  for (const auto& [a, b] : flat_ranges(p)) {
    pieces_range(n, count, a, b, to, pieces, cache);
    to += b - a;
  }
  return optim::join_param_states(kind, piece_shape(p), pieces);
}

std::string Slices::state(optim::Kind kind, const std::string& name, at::IntArrayRef shape) const {
  const std::string n = resolve(name);
  if (reader_.contains(n)) return reader_.bytes(n);
  std::vector<optim::StatePiece> pieces;
  const int64_t count = c10::multiply_integers(shape);
  state_pieces(n, shape, 0, count, 0, pieces);
  return optim::join_param_states(kind, shape, pieces);
}

std::vector<int64_t> saved_shape(const at::Tensor& t) {
  const std::optional<Placement> p = placement_of(t);
  return p ? p->whole : t.sizes().vec();
}

at::Tensor read_tensor(const Slices& r, const std::string& name, const at::Tensor& t) {
  const std::optional<Placement> p = placement_of(t);
  return p ? r.piece(name, *p) : r.tensor(name, t.sizes());
}

std::string read_state(const Slices& r, optim::Kind kind, const std::string& name,
                       const at::Tensor& param) {
  const std::optional<Placement> p = placement_of(param);
  return p ? r.piece_state(kind, name, *p) : r.state(kind, name, param.sizes());
}

}  // namespace tandem::checkpoint
