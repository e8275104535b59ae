#include "common/daemon/log_format.h"

#include <unistd.h>

#include <cerrno>
#include <iostream>
#include <mutex>
#include <streambuf>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/support/log.h"
#include "nlohmann/json.hpp"

namespace tessera {
namespace {

// The component named in every line; set once by InstallLogFormat.
std::string& Component() {
  static auto* component = new std::string();
  return *component;
}

void WriteLine(const std::string& json) {
  static std::mutex* mu = new std::mutex();
  std::string line = json + "\n";
  std::lock_guard<std::mutex> lock(*mu);
  size_t written = 0;
  while (written < line.size()) {
    const ssize_t n = write(STDERR_FILENO, line.data() + written, line.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere left to log
    written += static_cast<size_t>(n);
  }
}

// std::cerr's buffer in JSON mode: characters gather per thread until a newline, then the line
// is written as one JSON object. std::endl's flush does not cut a line short.
class JsonLineBuffer final : public std::streambuf {
 protected:
  int overflow(int c) override {
    if (c == traits_type::eof()) return traits_type::not_eof(c);
    Append(static_cast<char>(c));
    return c;
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    for (std::streamsize i = 0; i < n; ++i) Append(s[i]);
    return n;
  }

 private:
  static std::string& Pending() {
    thread_local std::string pending;
    return pending;
  }
  static void Append(char c) {
    std::string& pending = Pending();
    if (c != '\n') {
      pending.push_back(c);
      return;
    }
    WriteLine(JsonLogLine(absl::ToUnixNanos(absl::Now()), Component(), pending));
    pending.clear();
  }
};

void GrpcLogToJson(gpr_log_func_args* args) {
  WriteLine(JsonLogLine(absl::ToUnixNanos(absl::Now()), Component(),
                        args->message != nullptr ? args->message : "",
                        gpr_log_severity_string(args->severity),
                        absl::StrCat(args->file != nullptr ? args->file : "", ":", args->line)));
}

}  // namespace

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("--log_format: '", name, "' is neither text nor json"));
}

std::string JsonLogLine(int64_t time_ns, absl::string_view component, absl::string_view message,
                        absl::string_view severity, absl::string_view source) {
  nlohmann::ordered_json line;
  line["time"] = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixNanos(time_ns),
                                  absl::UTCTimeZone());
  if (!severity.empty()) line["severity"] = std::string(severity);
  line["component"] = std::string(component);
  line["pid"] = static_cast<int64_t>(getpid());
  line["message"] = std::string(message);
  if (!source.empty()) line["source"] = std::string(source);
  // Bytes that are not UTF-8 (a path, a child's output) become U+FFFD rather than an exception.
  return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void InstallLogFormat(LogFormat format, const std::string& component) {
  if (format == LogFormat::kText) return;
  Component() = component;
  static auto* buffer = new JsonLineBuffer();  // lives as long as the streams that use it
  std::cerr.rdbuf(buffer);
  std::clog.rdbuf(buffer);
  gpr_set_log_function(GrpcLogToJson);
}

}  // namespace tessera
