// How a daemon writes its log: plain text lines (the default, for people at a terminal) or one
// JSON object per line for cluster log collectors (Fluent Bit, Vector, Loki, Cloud Logging),
// chosen by the daemons' --log_format flag.
//
// JSON mode replaces the stream buffers of std::cerr and std::clog: every complete line a thread
// writes becomes {"time": RFC 3339 UTC, "component": ..., "pid": ..., "message": ...} on standard
// error in one write(2), so lines of different threads never interleave. gRPC's own log lines go
// the same way, with their "severity" and "source" (file:line). Text mode changes nothing.
//
// Thread safety: InstallLogFormat once, early in main(), before other threads log; afterwards
// any thread may write to std::cerr. A line is buffered per thread until its newline.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tessera {

enum class LogFormat { kText, kJson };

// "text" or "json"; INVALID_ARGUMENT naming --log_format otherwise.
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);

// `component` ("coordinator", "worker") is written into every JSON line.
void InstallLogFormat(LogFormat format, const std::string& component);

// The JSON object (without newline) that JSON mode writes for `message` at `time_ns` (Unix
// nanoseconds); `severity` and `source` are left out when empty.
std::string JsonLogLine(int64_t time_ns, absl::string_view component, absl::string_view message,
                        absl::string_view severity = "", absl::string_view source = "");

}  // namespace tessera
