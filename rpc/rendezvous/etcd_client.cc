// EtcdClient (rpc/rendezvous/etcd_client.h).
#include "tandem/rpc/rendezvous/etcd_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "tandem/rpc/common/dial.h"

namespace tandem::rpc {

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// The string value of "field" in a flat JSON text at or after `from`
// (etcd's answers: keys and values are base64, numbers are strings).
std::optional<std::string> json_string(const std::string& json, const std::string& field,
                                       size_t from = 0) {
  const std::string needle = "\"" + field + "\":";
  size_t at = json.find(needle, from);
  if (at == std::string::npos) return std::nullopt;
  at += needle.size();
  while (at < json.size() && json[at] == ' ') ++at;
  if (at >= json.size()) return std::nullopt;
  if (json[at] == '"') {
    const size_t end = json.find('"', at + 1);  // (base64 and numbers hold no quotes)
    if (end == std::string::npos) return std::nullopt;
    return json.substr(at + 1, end - at - 1);
  }
  size_t end = at;
  while (end < json.size() && json[end] != ',' && json[end] != '}' && json[end] != ']') ++end;
  return json.substr(at, end - at);
}

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

// The key just after every key with this prefix (etcd's range_end for a prefix).
std::string prefix_end(std::string prefix) {
  while (!prefix.empty()) {
    unsigned char last = static_cast<unsigned char>(prefix.back());
    if (last < 0xff) {
      prefix.back() = static_cast<char>(last + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');
}

}  // namespace

std::string base64_encode(const std::string& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t n = (static_cast<uint8_t>(in[i]) << 16) |
                       (static_cast<uint8_t>(in[i + 1]) << 8) | static_cast<uint8_t>(in[i + 2]);
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += kAlphabet[(n >> 6) & 63];
    out += kAlphabet[n & 63];
  }
  if (i + 1 == in.size()) {
    const uint32_t n = static_cast<uint8_t>(in[i]) << 16;
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const uint32_t n = (static_cast<uint8_t>(in[i]) << 16) | (static_cast<uint8_t>(in[i + 1]) << 8);
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += kAlphabet[(n >> 6) & 63];
    out += '=';
  }
  return out;
}

std::string base64_decode(const std::string& in) {
  int value[256];
  for (int& v : value) v = -1;
  for (int i = 0; i < 64; ++i) value[static_cast<unsigned char>(kAlphabet[i])] = i;
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    const int v = value[static_cast<unsigned char>(c)];
    if (v < 0) {
      if (c == '=') break;
      throw EtcdError("etcd: an answer's base64 holds '" + std::string(1, c) + "'");
    }
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

EtcdClient::EtcdClient(const std::string& endpoints, std::chrono::milliseconds call_timeout)
    : timeout_(call_timeout) {
  std::string list = endpoints;
  if (list.rfind("etcd://", 0) == 0) list = list.substr(7);
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = list.find(',', start);
    const std::string item =
        list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) {
      const size_t colon = item.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == item.size() ||
          item.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
        throw std::invalid_argument("etcd endpoint '" + item + "' is not host:port");
      }
      endpoints_.push_back(item);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (endpoints_.empty()) {
    throw std::invalid_argument("etcd: no endpoints in '" + endpoints + "' (host:port,...)");
  }
}

EtcdClient::~EtcdClient() { disconnect(); }

void EtcdClient::disconnect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {

// A number of an answer's (a length, a chunk's size in hex, a count); a
// malformed one is the member's fault: EtcdError, so that another is tried.
uint64_t number_of(const std::string& text, int base, const char* what) {
  const char* p = text.c_str();
  while (*p == ' ' || *p == '\t') ++p;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(p, &end, base);
  if (end == p || errno != 0 || *p == '-') {
    throw EtcdError(std::string("etcd: an answer's ") + what + " is not a number: '" +
                    text.substr(0, 20) + "'");
  }
  return v;
}

}  // namespace

std::string EtcdClient::call(const std::string& path, const std::string& body) {
  // Round the members until one answers or the call's time is up: a member
  // may be gone, or wait for an election after the leader went (a try
  // gets at most a second of it, so that another member has its turn).
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  std::vector<std::string> last(endpoints_.size());
  const size_t first = current_;
  for (size_t tried = 0;; ++tried) {
    const size_t member = (first + tried) % endpoints_.size();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 && tried >= endpoints_.size()) break;
    const auto budget =
        std::max(std::chrono::milliseconds(100), std::min(left, std::chrono::milliseconds(1000)));
    // A kept connection may have been closed by the server: one fresh try.
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        std::string answer = call_once(member, path, body, budget);
        current_ = member;
        return answer;
      } catch (const EtcdError& e) {
        disconnect();
        last[member] = e.what();
        if (std::string(e.what()).find("(kept)") == std::string::npos) break;
      }
    }
    if (member + 1 == endpoints_.size() || (first + tried + 1) % endpoints_.size() == first) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a round done: a pause
    }
  }
  std::string errors;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    errors += (i ? "; " : "") + endpoints_[i] + ": " + last[i];
  }
  throw EtcdError("etcd: no member of the cluster answers within " +
                  std::to_string(timeout_.count()) + " ms (" + errors + ")");
}

std::string EtcdClient::call_once(size_t member, const std::string& path, const std::string& body,
                                  std::chrono::milliseconds timeout) {
  const bool kept = fd_ >= 0 && member == connected_;
  if (!kept) {
    disconnect();
    const std::string& ep = endpoints_[member];
    const size_t colon = ep.rfind(':');
    Dialed d = dial_tcp(ep.substr(0, colon),
                        static_cast<int>(number_of(ep.substr(colon + 1), 10, "port")), timeout);
    if (d.fd < 0) throw EtcdError(d.why);
    fd_ = d.fd;
    connected_ = member;
  }
  const std::string tag = kept ? " (kept)" : "";
  const std::string request =
      "POST " + path + " HTTP/1.1\r\nHost: " + endpoints_[member] +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\n\r\n" + body;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto wait_for = [&](short events) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0)
      throw EtcdError("no answer within " + std::to_string(timeout.count()) + " ms" + tag);
    pollfd p{fd_, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left));
    if (n < 0 && errno != EINTR)
      throw EtcdError(std::string("poll: ") + std::strerror(errno) + tag);
  };
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd_, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      wait_for(POLLOUT);
    } else {
      throw EtcdError(std::string("send: ") + std::strerror(errno) + tag);
    }
  }
  // The answer: headers, then Content-Length bytes or chunks.
  std::string in;
  auto read_more = [&] {
    char buf[16384];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n > 0) {
        in.append(buf, static_cast<size_t>(n));
        return;
      }
      if (n == 0) throw EtcdError("the connection closed" + tag);
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        wait_for(POLLIN);
      } else {
        throw EtcdError(std::string("recv: ") + std::strerror(errno) + tag);
      }
    }
  };
  size_t head_end;
  while ((head_end = in.find("\r\n\r\n")) == std::string::npos) {
    if (in.size() > (1 << 16)) throw EtcdError("an answer's headers exceed 64 KiB");
    read_more();
  }
  const std::string head = in.substr(0, head_end);
  int status = 0;
  if (std::sscanf(head.c_str(), "HTTP/1.%*d %d", &status) != 1) {
    throw EtcdError("not an HTTP answer: '" + head.substr(0, 40) + "'");
  }
  std::string lower;
  for (char c : head) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string body_out;
  size_t at = head_end + 4;
  if (lower.find("transfer-encoding: chunked") != std::string::npos) {
    for (;;) {
      size_t line_end;
      while ((line_end = in.find("\r\n", at)) == std::string::npos) read_more();
      const uint64_t size = number_of(in.substr(at, line_end - at), 16, "chunk size");
      if (size > (uint64_t{1} << 30))
        throw EtcdError("an answer's chunk of " + std::to_string(size) + " bytes");
      at = line_end + 2;
      if (size == 0) {
        // The trailer: header lines up to an empty one.
        for (;;) {
          while ((line_end = in.find("\r\n", at)) == std::string::npos) read_more();
          const bool empty = line_end == at;
          at = line_end + 2;
          if (empty) break;
        }
        break;
      }
      while (in.size() < at + size + 2) read_more();
      body_out.append(in, at, size);
      at += size + 2;
    }
  } else {
    const size_t cl = lower.find("content-length:");
    if (cl == std::string::npos) throw EtcdError("an answer without a length");
    const size_t length = number_of(lower.substr(cl + 15, 24), 10, "Content-Length");
    if (length > (size_t{1} << 30))
      throw EtcdError("an answer of " + std::to_string(length) + " bytes");
    while (in.size() < at + length) read_more();
    body_out = in.substr(at, length);
  }
  if (lower.find("connection: close") != std::string::npos) disconnect();
  if (status >= 500)
    throw EtcdError("HTTP " + std::to_string(status) + ": " + body_out.substr(0, 200));
  if (status != 200) {
    // A request the cluster refused is no reason to try another member.
    disconnect();
    throw std::runtime_error("etcd " + endpoints_[member] + " " + path + ": HTTP " +
                             std::to_string(status) + ": " + body_out.substr(0, 200));
  }
  return body_out;
}

void EtcdClient::put(const std::string& key, const std::string& value) {
  call("/v3/kv/put", "{\"key\":" + quoted(base64_encode(key)) +
                         ",\"value\":" + quoted(base64_encode(value)) + "}");
}

std::optional<std::string> EtcdClient::get(const std::string& key) {
  const std::string answer = call("/v3/kv/range", "{\"key\":" + quoted(base64_encode(key)) + "}");
  const size_t kvs = answer.find("\"kvs\"");
  if (kvs == std::string::npos) return std::nullopt;
  return base64_decode(json_string(answer, "value", kvs).value_or(""));
}

bool EtcdClient::swap(const std::string& key, const std::optional<std::string>& expected,
                      const std::string& desired) {
  const std::string k = quoted(base64_encode(key));
  const std::string compare =
      !expected ? "{\"key\":" + k +
                      ",\"result\":\"EQUAL\",\"target\":\"CREATE\",\"create_revision\":\"0\"}"
                : "{\"key\":" + k + ",\"result\":\"EQUAL\",\"target\":\"VALUE\",\"value\":" +
                      quoted(base64_encode(*expected)) + "}";
  const std::string body = "{\"compare\":[" + compare +
                           "],\"success\":[{\"request_put\":{\"key\":" + k +
                           ",\"value\":" + quoted(base64_encode(desired)) + "}}]}";
  return json_string(call("/v3/kv/txn", body), "succeeded").value_or("false") == "true";
}

std::string EtcdClient::compare_and_set(const std::string& key, const std::string& expected,
                                        const std::string& desired) {
  const std::string k = quoted(base64_encode(key));
  const std::string compare =
      expected.empty()
          ? "{\"key\":" + k +
                ",\"result\":\"EQUAL\",\"target\":\"CREATE\",\"create_revision\":\"0\"}"
          : "{\"key\":" + k + ",\"result\":\"EQUAL\",\"target\":\"VALUE\",\"value\":" +
                quoted(base64_encode(expected)) + "}";
  const std::string body = "{\"compare\":[" + compare +
                           "],\"success\":[{\"request_put\":{\"key\":" + k +
                           ",\"value\":" + quoted(base64_encode(desired)) +
                           "}}],\"failure\":[{\"request_range\":{\"key\":" + k + "}}]}";
  const std::string answer = call("/v3/kv/txn", body);
  if (json_string(answer, "succeeded").value_or("false") == "true") return desired;
  const size_t kvs = answer.find("\"kvs\"");
  if (kvs == std::string::npos) return {};
  return base64_decode(json_string(answer, "value", kvs).value_or(""));
}

bool EtcdClient::erase(const std::string& key) {
  const std::string answer =
      call("/v3/kv/deleterange", "{\"key\":" + quoted(base64_encode(key)) + "}");
  return json_string(answer, "deleted").value_or("0") != "0";
}

int64_t EtcdClient::count(const std::string& prefix) {
  const std::string answer =
      call("/v3/kv/range", "{\"key\":" + quoted(base64_encode(prefix)) + ",\"range_end\":" +
                               quoted(base64_encode(prefix_end(prefix))) + ",\"count_only\":true}");
  return static_cast<int64_t>(number_of(json_string(answer, "count").value_or("0"), 10, "count"));
}

}  // namespace tandem::rpc
