// Status: the error channel of every host entry point. No exceptions cross the C++ API;
// bindings turn a failed Status into their own error type.
#pragma once
#include <string>
#include <utility>

namespace mxflash {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // a caller's argument broke a documented rule; nothing was written
  kUnsupported,      // valid request this build or device cannot run (e.g. no CUDA)
  kCudaError,        // a CUDA runtime call or launch failed
  kInternal,
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Invalid(std::string msg) { return Status(StatusCode::kInvalidArgument, std::move(msg)); }
  static Status Unsupported(std::string msg) { return Status(StatusCode::kUnsupported, std::move(msg)); }
  static Status Cuda(std::string msg) { return Status(StatusCode::kCudaError, std::move(msg)); }
  static Status Internal(std::string msg) { return Status(StatusCode::kInternal, std::move(msg)); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(StatusCode c, std::string m) : code_(c), message_(std::move(m)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Early return on a failed Status.
#define MXFLASH_RETURN_IF_ERROR(expr)        \
  do {                                       \
    ::mxflash::Status _mxf_st = (expr);      \
    if (!_mxf_st.ok()) return _mxf_st;       \
  } while (0)

}  // namespace mxflash
