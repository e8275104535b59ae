// The pending-reason stage of a scheduling pass: which of the reasons the pass found for its
// waiting jobs ("quota of queue nlp: 56 of 64 GPUs in use", "no node has 8 free GPUs") are worth a
// store write. A PENDING job's reason is written when it changes, but one whose figures alone
// changed (use, fair share, a job it waits behind) at most every kRefresh: in a busy cluster the
// figures change with every start and end, and rewriting thousands of waiting jobs each pass would
// cost more than the pass itself. A RESTARTING job keeps its state, and the reason it restarts,
// until it is placed again.
//
// It remembers when it last wrote each job's reason; jobs no longer waiting are forgotten.
// Thread safety: not thread-safe; the scheduling pass owns one and runs one pass at a time.
#pragma once

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

// `reason` with every number (a run of digits, with any decimal point inside) replaced by '#':
// two reasons of one shape differ only in figures ("56 of 64 GPUs in use" and "60 of 64 ...").
std::string ReasonShape(absl::string_view reason);

class PendingReasons {
 public:
  static constexpr absl::Duration kRefresh = absl::Seconds(30);

  // The (job id, reason) pairs of `reasons` to store now, at `now`, in job id order. `listed`:
  // the pass's waiting jobs as stored (their state and current reason); ids not among them are
  // skipped.
  std::vector<std::pair<std::string, std::string>> ToWrite(
      const std::map<std::string, std::string>& reasons, const std::vector<v1::Job>& listed,
      absl::Time now);
  // Forgets the jobs that no longer wait (all of them when `waiting` is empty).
  void Keep(const std::set<std::string>& waiting);

 private:
  // When each waiting job's reason was last handed out for writing by this process.
  std::map<std::string, absl::Time> written_;
};

}  // namespace tessera::coordinator
