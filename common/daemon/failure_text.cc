#include "common/daemon/failure_text.h"

#include <string.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace tessera {
namespace {

std::string Where(const v1::TrainerFailure& failure) {
  std::string where = absl::StrCat("rank ", failure.rank());
  if (!failure.node_id().empty()) absl::StrAppend(&where, " on ", failure.node_id());
  return where;
}

std::string AtStep(const v1::TrainerFailure& failure) {
  return failure.step() > 0 ? absl::StrCat(" at step ", failure.step()) : "";
}

// The first line of a message, without the log excerpt workers append.
std::string Headline(const std::string& message) {
  std::string line(absl::StripAsciiWhitespace(*absl::StrSplit(message, '\n').begin()));
  size_t excerpt = line.find("; last lines of ");
  if (excerpt != std::string::npos) line.resize(excerpt);
  return line;
}

}  // namespace

std::string DescribeFailure(const v1::TrainerFailure& failure) {
  if (failure.kind() == v1::FAILURE_KIND_NODE_LOST) {
    return absl::StrCat("node ", failure.node_id(), " was lost",
                        failure.message().empty() ? "" : ": ", Headline(failure.message()));
  }
  if (failure.kind() == v1::FAILURE_KIND_PROCESS_EXIT && failure.rank() >= 0) {
    if (failure.signal() != 0) {
      const char* name = sigabbrev_np(failure.signal());
      return absl::StrCat(Where(failure), " was killed by signal ", failure.signal(),
                          name == nullptr ? "" : absl::StrCat(" (SIG", name, ")"), AtStep(failure));
    }
    if (failure.exit_code() != 0) {
      return absl::StrCat(Where(failure), " exited with code ", failure.exit_code(),
                          AtStep(failure));
    }
  }
  std::string kind(absl::StripPrefix(v1::FailureKind_Name(failure.kind()), "FAILURE_KIND_"));
  std::string who = failure.rank() >= 0         ? Where(failure)
                    : failure.node_id().empty() ? std::string("the job")
                                                : absl::StrCat("node ", failure.node_id());
  return absl::StrCat(who, " failed", AtStep(failure), ": ", kind,
                      failure.message().empty() ? "" : ": ", Headline(failure.message()));
}

}  // namespace tessera
