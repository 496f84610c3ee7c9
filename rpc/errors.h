// The one error vocabulary of Tandem's RPC layer, used on the wire and in the API.
//
// Every failed call surfaces as one of these exceptions (all derive from
// tandem::rpc::Error, itself a std::runtime_error):
//   RemoteError          the function threw on the callee; carries the worker and its message
//   TimeoutError         no reply before the call's deadline
//   DisconnectedError    the connection to the peer is gone (peer died, refused, closed)
//   UnknownFunctionError the callee has no function registered under that name
//   ShutdownError        the local or remote agent is shutting down
//   ProtocolError        a malformed frame, or a peer that broke the protocol
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

namespace tandem::rpc {

enum class ErrorCode : uint8_t {
  kRemote = 0,
  kTimeout = 1,
  kDisconnected = 2,
  kUnknownFunction = 3,
  kShutdown = 4,
  kProtocol = 5,
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

class RemoteError : public Error {
 public:
  RemoteError(std::string worker, std::string message);
  const std::string& worker() const { return worker_; }
  // The message of the exception thrown on the remote worker.
  const std::string& remote_message() const { return remote_message_; }

 private:
  std::string worker_;
  std::string remote_message_;
};

class TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& what) : Error(ErrorCode::kTimeout, what) {}
};

class DisconnectedError : public Error {
 public:
  explicit DisconnectedError(const std::string& what) : Error(ErrorCode::kDisconnected, what) {}
};

class UnknownFunctionError : public Error {
 public:
  explicit UnknownFunctionError(const std::string& what)
      : Error(ErrorCode::kUnknownFunction, what) {}
};

class ShutdownError : public Error {
 public:
  explicit ShutdownError(const std::string& what) : Error(ErrorCode::kShutdown, what) {}
};

class ProtocolError : public Error {
 public:
  explicit ProtocolError(const std::string& what) : Error(ErrorCode::kProtocol, what) {}
};

// Builds the typed exception for an error that arrived from `worker`.
std::exception_ptr make_error(ErrorCode code, const std::string& worker,
                              const std::string& message);

// Splits a caught exception into what goes on the wire: its code and message.
// Exceptions other than tandem::rpc::Error become kRemote.
std::pair<ErrorCode, std::string> describe_error(std::exception_ptr eptr);

}  // namespace tandem::rpc
