#include "tandem/rpc/errors.h"

#include <c10/util/Exception.h>

namespace tandem::rpc {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kRemote:
      return "RemoteError";
    case ErrorCode::kTimeout:
      return "Timeout";
    case ErrorCode::kDisconnected:
      return "Disconnected";
    case ErrorCode::kUnknownFunction:
      return "UnknownFunction";
    case ErrorCode::kShutdown:
      return "Shutdown";
    case ErrorCode::kProtocol:
      return "Protocol";
  }
  return "Unknown";
}

RemoteError::RemoteError(std::string worker, std::string message)
    : Error(ErrorCode::kRemote, "Error on " + worker + ": " + message),
      worker_(std::move(worker)),
      remote_message_(std::move(message)) {}

std::exception_ptr make_error(ErrorCode code, const std::string& worker,
                              const std::string& message) {
  const std::string where = worker.empty() ? message : message + " (worker " + worker + ")";
  switch (code) {
    case ErrorCode::kRemote:
      return std::make_exception_ptr(RemoteError(worker, message));
    case ErrorCode::kTimeout:
      return std::make_exception_ptr(TimeoutError(where));
    case ErrorCode::kDisconnected:
      return std::make_exception_ptr(DisconnectedError(where));
    case ErrorCode::kUnknownFunction:
      return std::make_exception_ptr(UnknownFunctionError(where));
    case ErrorCode::kShutdown:
      return std::make_exception_ptr(ShutdownError(where));
    case ErrorCode::kProtocol:
      return std::make_exception_ptr(ProtocolError(where));
  }
  return std::make_exception_ptr(RemoteError(worker, message));
}

std::pair<ErrorCode, std::string> describe_error(std::exception_ptr eptr) {
  try {
    std::rethrow_exception(eptr);
  } catch (const RemoteError& e) {
    // A nested call failed remotely: keep the innermost worker's words.
    return {ErrorCode::kRemote, e.what()};
  } catch (const Error& e) {
    return {e.code(), e.what()};
  } catch (const c10::Error& e) {
    return {ErrorCode::kRemote, e.what_without_backtrace()};
  } catch (const std::exception& e) {
    return {ErrorCode::kRemote, e.what()};
  } catch (...) {
    return {ErrorCode::kRemote, "unknown exception"};
  }
}

}  // namespace tandem::rpc
