#include "trainer/data/hf_tokenizer.h"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

extern char** environ;

namespace tessera::trainer {
namespace {

namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little,
              "the tokenizer protocol is little-endian, as is this host's memory");

constexpr char kTokenizerJson[] = "tokenizer.json";
constexpr char kServerName[] = "hf_tokenizer_server.py";
// Document-end tokens by family, in the order they are preferred when several are present: a
// chat model has both its pretraining eos (first) and its end-of-turn token (last).
constexpr std::array<const char*, 6> kEosCandidates = {
    "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>"};
constexpr char kHowToFix[] =
    "run scripts/bootstrap.sh (its torch venv has the `tokenizers` package), or set "
    "TESSERA_PYTHON to a python that can `import tokenizers`";
// How long the destructor waits for the child to exit on EOF before it kills it.
constexpr absl::Duration kExitGrace = absl::Seconds(2);

// The protocol of hf_tokenizer_server.py (see there): a 1-byte op or status, a u64 length.
constexpr size_t kHeaderSize = 9;
constexpr char kEncodeOp = 'E';
constexpr char kDecodeOp = 'D';
constexpr char kOk = 'O';

std::string DefaultPython() {
  if (const char* python = std::getenv(kTesseraPythonEnv); python != nullptr && *python != '\0') {
    return python;
  }
#ifdef TESSERA_DEFAULT_PYTHON
  return TESSERA_DEFAULT_PYTHON;
#else
  return "python3";
#endif
}

absl::StatusOr<std::string> FindServerScript() {
  if (const char* path = std::getenv(kHfTokenizerServerEnv); path != nullptr && *path != '\0') {
    return std::string(path);
  }
  std::vector<std::string> candidates;
  std::error_code error;
  const fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (!error) candidates.push_back((exe.parent_path() / ".." / "lib" / kServerName).string());
#ifdef TESSERA_HF_TOKENIZER_SERVER_PATH
  candidates.push_back(TESSERA_HF_TOKENIZER_SERVER_PATH);
#endif
  for (const std::string& candidate : candidates) {
    if (access(candidate.c_str(), R_OK) == 0) return candidate;
  }
  return absl::FailedPreconditionError(absl::StrCat("cannot find ", kServerName, " (looked at ",
                                                    absl::StrJoin(candidates, ", "), "); set ",
                                                    kHfTokenizerServerEnv, " to its path"));
}

absl::Duration Remaining(absl::Time deadline) {
  return std::max(deadline - absl::Now(), absl::ZeroDuration());
}

// Waits until `fd` is ready for `events`; DEADLINE_EXCEEDED past `deadline`.
absl::Status WaitFor(int fd, short events, absl::Time deadline, const std::string& what) {
  while (true) {
    pollfd entry = {.fd = fd, .events = events, .revents = 0};
    const int64_t ms = absl::ToInt64Milliseconds(Remaining(deadline));
    const int ready = poll(&entry, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (ready > 0) return absl::OkStatus();
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return absl::InternalError(absl::StrCat(what, ": poll: ", std::strerror(errno)));
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": no answer from the tokenizer process"));
  }
}

// MSG_NOSIGNAL: a dead child is an EPIPE error here, not a SIGPIPE that ends this process.
absl::Status WriteAll(int fd, std::string_view data, absl::Time deadline, const std::string& what) {
  while (!data.empty()) {
    RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline, what));
    const ssize_t sent = send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return absl::UnavailableError(
          absl::StrCat(what, ": the tokenizer process is gone: ", std::strerror(errno)));
    }
    data.remove_prefix(static_cast<size_t>(sent));
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, char* data, size_t size, absl::Time deadline,
                     const std::string& what) {
  while (size > 0) {
    RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, what));
    const ssize_t got = recv(fd, data, size, MSG_DONTWAIT);
    if (got == 0) {
      return absl::UnavailableError(absl::StrCat(what, ": the tokenizer process exited"));
    }
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
    }
    data += got;
    size -= static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

struct Frame {
  char status = 0;
  std::string payload;
};

absl::StatusOr<Frame> ReadFrame(int fd, absl::Time deadline, const std::string& what) {
  char header[kHeaderSize];
  RETURN_IF_ERROR(ReadAll(fd, header, sizeof(header), deadline, what));
  Frame frame;
  frame.status = header[0];
  uint64_t size = 0;
  std::memcpy(&size, header + 1, sizeof(size));
  frame.payload.resize(size);
  RETURN_IF_ERROR(ReadAll(fd, frame.payload.data(), size, deadline, what));
  return frame;
}

void AppendU32(std::string& out, uint32_t value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(value));
}

// Closes the child's stdin (its cue to exit), then waits up to kExitGrace before SIGKILL.
void EndChild(pid_t pid, int fd) {
  if (fd >= 0) close(fd);
  const absl::Time deadline = absl::Now() + kExitGrace;
  while (true) {
    const pid_t done = waitpid(pid, nullptr, WNOHANG);
    if (done == pid || (done < 0 && errno != EINTR)) return;
    if (absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  kill(pid, SIGKILL);
  while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
}

// Thread-safe: mu_ serializes the requests on the one socket to the child.
class HfTokenizer final : public Tokenizer {
 public:
  HfTokenizer(std::string path, pid_t pid, int fd, uint32_t vocab_size, uint32_t eos_id,
              absl::Duration request_timeout)
      : path_(std::move(path)),
        pid_(pid),
        fd_(fd),
        vocab_size_(vocab_size),
        eos_id_(eos_id),
        request_timeout_(request_timeout) {}
  ~HfTokenizer() override { EndChild(pid_, fd_); }
  HfTokenizer(const HfTokenizer&) = delete;
  HfTokenizer& operator=(const HfTokenizer&) = delete;

  std::vector<uint32_t> Encode(std::string_view text) const override {
    return std::move(EncodeBatch(std::span<const std::string_view>(&text, 1))[0]);
  }

  std::vector<std::vector<uint32_t>> EncodeBatch(
      std::span<const std::string_view> texts) const override {
    std::vector<std::vector<uint32_t>> tokens(texts.size());
    std::string request;
    AppendU32(request, static_cast<uint32_t>(texts.size()));
    for (std::string_view text : texts) {
      if (text.size() > UINT32_MAX) {
        Fail(absl::InvalidArgumentError(
            absl::StrCat(path_, ": cannot encode a text of ", text.size(), " bytes (4 GiB max)")));
        return tokens;
      }
      AppendU32(request, static_cast<uint32_t>(text.size()));
      request.append(text);
    }
    absl::StatusOr<std::string> answer = Call(kEncodeOp, request);
    if (!answer.ok()) return tokens;
    std::string_view rest = *answer;
    for (std::vector<uint32_t>& ids : tokens) {
      uint32_t count = 0;
      if (rest.size() >= sizeof(count)) std::memcpy(&count, rest.data(), sizeof(count));
      if (rest.size() < sizeof(count) + uint64_t{count} * sizeof(uint32_t)) {
        Fail(absl::InternalError(absl::StrCat(path_, ": a truncated encode answer")));
        return std::vector<std::vector<uint32_t>>(texts.size());
      }
      ids.resize(count);
      std::memcpy(ids.data(), rest.data() + sizeof(count), count * sizeof(uint32_t));
      rest.remove_prefix(sizeof(count) + count * sizeof(uint32_t));
    }
    return tokens;
  }

  std::string Decode(std::span<const uint32_t> tokens) const override {
    std::string request;
    for (uint32_t token : tokens) {
      if (token < vocab_size_) AppendU32(request, token);
    }
    absl::StatusOr<std::string> answer = Call(kDecodeOp, request);
    return answer.ok() ? *std::move(answer) : std::string();
  }

  uint32_t vocab_size() const override { return vocab_size_; }
  uint32_t eos_id() const override { return eos_id_; }

  absl::Status status() const override {
    absl::MutexLock lock(&mu_);
    return failure_;
  }

 private:
  // One request and its answer. The first failure sticks: the stream may be out of step after
  // it, and a caller that checks status() only at the end must still see it.
  absl::StatusOr<std::string> Call(char op, const std::string& payload) const {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) return failure_;
    const absl::Time deadline = absl::Now() + request_timeout_;
    std::string message(1, op);
    const uint64_t size = payload.size();
    message.append(reinterpret_cast<const char*>(&size), sizeof(size));
    message.append(payload);
    const std::string what = absl::StrCat(path_, ": ", op == kEncodeOp ? "encode" : "decode");
    absl::Status sent = WriteAll(fd_, message, deadline, what);
    if (!sent.ok()) return failure_ = sent;
    absl::StatusOr<Frame> frame = ReadFrame(fd_, deadline, what);
    if (!frame.ok()) return failure_ = frame.status();
    if (frame->status != kOk) {
      return failure_ = absl::InvalidArgumentError(absl::StrCat(what, ": ", frame->payload));
    }
    return std::move(frame->payload);
  }

  void Fail(absl::Status status) const {
    absl::MutexLock lock(&mu_);
    if (failure_.ok()) failure_ = std::move(status);
  }

  const std::string path_;
  const pid_t pid_;
  const int fd_;
  const uint32_t vocab_size_;
  const uint32_t eos_id_;
  const absl::Duration request_timeout_;
  mutable absl::Mutex mu_;
  mutable absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

// The eos id among the handshake's added tokens (see HfTokenizerOptions::eos_token).
absl::StatusOr<uint32_t> PickEos(const std::string& path, const nlohmann::json& added_tokens,
                                 const std::string& eos_token) {
  const auto find = [&](std::string_view content) -> const nlohmann::json* {
    for (const nlohmann::json& token : added_tokens) {
      if (token.at("content").get<std::string>() == content) return &token;
    }
    return nullptr;
  };
  std::vector<std::string> names;
  for (const nlohmann::json& token : added_tokens) {
    names.push_back(token.at("content").get<std::string>());
  }
  if (!eos_token.empty()) {
    if (const nlohmann::json* token = find(eos_token)) return token->at("id").get<uint32_t>();
    return absl::InvalidArgumentError(absl::StrCat(path, ": eos token \"", eos_token,
                                                   "\" is not an added token of the tokenizer (",
                                                   absl::StrJoin(names, " "), ")"));
  }
  for (const char* candidate : kEosCandidates) {
    if (const nlohmann::json* token = find(candidate)) return token->at("id").get<uint32_t>();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      path, ": the tokenizer has none of the eos tokens ", absl::StrJoin(kEosCandidates, " "),
      " among its added tokens (", absl::StrJoin(names, " "), "); name one with eos_token"));
}

// Reads the server's first frame: the tokenizer's facts, or why it could not load.
absl::StatusOr<std::unique_ptr<Tokenizer>> Handshake(const std::string& path,
                                                     const std::string& python, pid_t pid, int fd,
                                                     const HfTokenizerOptions& options) {
  absl::StatusOr<Frame> frame =
      ReadFrame(fd, absl::Now() + options.start_timeout, absl::StrCat(path, ": loading"));
  if (!frame.ok()) {
    if (absl::IsDeadlineExceeded(frame.status())) return frame.status();
    return absl::FailedPreconditionError(absl::StrCat(python, " exited before it loaded ", path,
                                                      " (its errors are above); ", kHowToFix));
  }
  const nlohmann::json answer = nlohmann::json::parse(frame->payload, nullptr, false);
  if (answer.is_discarded() || !answer.is_object()) {
    return absl::InternalError(absl::StrCat(path, ": a malformed answer from ", python));
  }
  if (frame->status != kOk) {
    const std::string message = answer.value("message", "");
    if (answer.value("kind", "") == "import") {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot import the `tokenizers` package: ", message, "; ", kHowToFix));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a Hugging Face tokenizer.json: ", message));
  }
  if (!answer.contains("vocab_size") || !answer.contains("added_tokens")) {
    return absl::InternalError(absl::StrCat(path, ": a malformed answer from ", python));
  }
  const uint32_t vocab_size = answer.at("vocab_size").get<uint32_t>();
  ASSIGN_OR_RETURN(const uint32_t eos_id,
                   PickEos(path, answer.at("added_tokens"), options.eos_token));
  return std::make_unique<HfTokenizer>(path, pid, fd, vocab_size, eos_id, options.request_timeout);
}

}  // namespace

bool IsHfTokenizerPath(const std::string& tokenizer) {
  const fs::path path(tokenizer);
  if (path.filename() == kTokenizerJson) return true;
  std::error_code error;
  return fs::is_directory(path, error) && fs::exists(path / kTokenizerJson, error);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& tokenizer_json,
                                                           const HfTokenizerOptions& options) {
  std::error_code error;
  std::string path = tokenizer_json;
  if (fs::is_directory(path, error)) path = (fs::path(path) / kTokenizerJson).string();
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(path, ": no such Hugging Face tokenizer.json"));
  }
  const std::string python = options.python.empty() ? DefaultPython() : options.python;
  std::string script = options.server_script;
  if (script.empty()) {
    ASSIGN_OR_RETURN(script, FindServerScript());
  }

  // A socket pair rather than two pipes: send() with MSG_NOSIGNAL makes a dead child an error,
  // not a SIGPIPE. CLOEXEC keeps our end out of every other child; dup2 clears it on the child's
  // stdin and stdout. The child's stderr is ours, so Python's tracebacks reach the user.
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return absl::InternalError(absl::StrCat("socketpair: ", std::strerror(errno)));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<std::string> argv_storage = {python, "-u", script, path};
  std::vector<char*> argv;
  for (std::string& arg : argv_storage) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  // posix_spawnp: "python3" is looked up on PATH; a path with a slash is used as it is.
  const int spawned = posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (spawned != 0) {
    close(fds[0]);
    return absl::FailedPreconditionError(absl::StrCat("cannot start python ", python, ": ",
                                                      std::strerror(spawned), "; ", kHowToFix));
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Handshake(path, python, pid, fds[0], options);
  if (!tokenizer.ok()) EndChild(pid, fds[0]);
  return tokenizer;
}

}  // namespace tessera::trainer
