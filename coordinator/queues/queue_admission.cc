#include "coordinator/queues/queue_admission.h"

#include <algorithm>
#include <deque>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera::coordinator {
namespace {

constexpr ResourceKind kKinds[] = {ResourceKind::kGpus, ResourceKind::kCpuSlots};

ResourceKind KindOf(const QueuedRequest& request) {
  return request.use_gpus ? ResourceKind::kGpus : ResourceKind::kCpuSlots;
}

bool Before(const QueuedRequest* a, const QueuedRequest* b) {
  return std::tie(b->priority, a->submit_order, a->job_id) <
         std::tie(a->priority, b->submit_order, b->job_id);
}

// One queue's requests of one resource, in queue order, and how far admission got.
struct Lane {
  const QueueSpec* queue = nullptr;
  std::vector<const QueuedRequest*> requests;
  size_t next = 0;
  // The head could not be admitted: nothing more from this lane in this pass.
  bool stopped = false;
};

// Per cohort (or queue without cohort) and resource: unused quota kept for waiting jobs.
struct Reservations {
  // Nominal quota of queues waiting for it to come back from borrowers.
  int64_t nominal = 0;
  // The one borrower holding back the others, if any.
  int64_t borrow = 0;
  std::string borrow_job;
  std::string borrow_queue;
};

}  // namespace

std::string QuotaLedger::CohortKey(const QueueSpec& queue) {
  return queue.cohort.empty() ? absl::StrCat("queue/", queue.name)
                              : absl::StrCat("cohort/", queue.cohort);
}

std::string QuotaLedger::CohortLabel(const QueueSpec& queue) {
  return queue.cohort.empty() ? absl::StrCat("queue ", queue.name)
                              : absl::StrCat("cohort ", queue.cohort);
}

QuotaLedger::QuotaLedger(const QueueConfig& config,
                         const std::map<std::string, Resources>& in_use) {
  for (const QueueSpec& queue : config.queues) {
    cohort_total_[CohortKey(queue)] += queue.nominal;
    cohort_used_[CohortKey(queue)];
    queue_used_[queue.name];
  }
  for (const auto& [name, resources] : in_use) {
    const QueueSpec* queue = config.Find(name);
    if (queue == nullptr) continue;
    queue_used_[name] += resources;
    cohort_used_[CohortKey(*queue)] += resources;
  }
}

int64_t QuotaLedger::Used(const QueueSpec& queue, ResourceKind kind) const {
  auto it = queue_used_.find(queue.name);
  return it == queue_used_.end() ? 0 : Get(it->second, kind);
}

int64_t QuotaLedger::CohortUsed(const QueueSpec& queue, ResourceKind kind) const {
  auto it = cohort_used_.find(CohortKey(queue));
  return it == cohort_used_.end() ? 0 : Get(it->second, kind);
}

int64_t QuotaLedger::CohortTotal(const QueueSpec& queue, ResourceKind kind) const {
  auto it = cohort_total_.find(CohortKey(queue));
  return it == cohort_total_.end() ? Get(queue.nominal, kind) : Get(it->second, kind);
}

int64_t QuotaLedger::Borrowed(const QueueSpec& queue, ResourceKind kind) const {
  return std::max<int64_t>(0, Used(queue, kind) - Get(queue.nominal, kind));
}

void QuotaLedger::Add(const QueueSpec& queue, ResourceKind kind, int64_t devices) {
  Get(queue_used_[queue.name], kind) += devices;
  Get(cohort_used_[CohortKey(queue)], kind) += devices;
}

std::optional<std::string> QuotaLedger::WhyOverLimit(const QueueSpec& queue, ResourceKind kind,
                                                     int64_t devices) const {
  const int64_t used = Used(queue, kind);
  const int64_t nominal = Get(queue.nominal, kind);
  if (used + devices <= nominal) return std::nullopt;
  const std::string head = Head(queue, kind, devices);
  if (queue.cohort.empty()) return head;
  const std::optional<int64_t> limit = queue.BorrowingLimit(kind);
  if (limit.has_value() && used + devices - nominal > *limit) {
    return absl::StrCat(head, "; it may borrow at most ", *limit, " ", ResourceName(kind),
                        " (borrowing ", Borrowed(queue, kind), " now)");
  }
  return std::nullopt;
}

std::string QuotaLedger::Head(const QueueSpec& queue, ResourceKind kind, int64_t devices) const {
  return absl::StrCat("queue ", queue.name, ": ", Used(queue, kind), " of ",
                      Get(queue.nominal, kind), " ", ResourceName(kind), " in use, needs ",
                      devices);
}

std::optional<std::string> QuotaLedger::WhyNotFit(const QueueSpec& queue, ResourceKind kind,
                                                  int64_t devices, int64_t reserved) const {
  if (auto over = WhyOverLimit(queue, kind, devices)) return over;
  const absl::string_view unit = ResourceName(kind);
  const int64_t cohort_used = CohortUsed(queue, kind);
  const int64_t unused = CohortTotal(queue, kind) - cohort_used;
  if (devices <= unused - reserved) return std::nullopt;
  const std::string head = Head(queue, kind, devices);
  if (Used(queue, kind) + devices <= Get(queue.nominal, kind)) {
    return absl::StrCat(head, ", but ", CohortLabel(queue),
                        " has lent its quota out: ", cohort_used, " of ", CohortTotal(queue, kind),
                        " ", unit, " in use there (waits for borrowed ", unit, " to come back)");
  }
  std::string reason = absl::StrCat(head, "; ", CohortLabel(queue), " has ",
                                    std::max<int64_t>(unused, 0), " ", unit, " unused to lend");
  if (reserved > 0) absl::StrAppend(&reason, " and holds ", reserved, " for waiting jobs");
  return reason;
}

std::optional<std::string> QuotaUnsatisfiable(const QueueConfig& config,
                                              const QueuedRequest& request) {
  if (config.implicit()) return std::nullopt;
  const QueueSpec* queue = config.Find(request.queue);
  if (queue == nullptr) return absl::StrCat("queue ", request.queue, " does not exist");
  const ResourceKind kind = KindOf(request);
  const absl::string_view unit = ResourceName(kind);
  const int64_t nominal = Get(queue->nominal, kind);
  const int64_t cohort_total = Get(config.CohortNominal(*queue), kind);
  int64_t most = nominal;
  std::string why = absl::StrCat("its nominal quota is ", nominal, " ", unit);
  if (!queue->cohort.empty()) {
    most = cohort_total;
    why = absl::StrCat("cohort ", queue->cohort, " holds ", cohort_total, " ", unit, " in all");
    const std::optional<int64_t> limit = queue->BorrowingLimit(kind);
    if (limit.has_value() && nominal + *limit < most) {
      most = nominal + *limit;
      why = absl::StrCat("nominal ", nominal, " + borrowing limit ", *limit, " ", unit);
    }
  }
  if (request.devices <= most) return std::nullopt;
  return absl::StrCat("needs ", request.devices, " ", unit, " but queue ", queue->name,
                      " may never use more than ", most, " (", why, ")");
}

QuotaAdmission AdmitByQuota(const QueueConfig& config,
                            const std::map<std::string, Resources>& in_use,
                            const std::map<std::string, double>& shares,
                            std::vector<QueuedRequest> requests) {
  QuotaAdmission result;
  std::vector<const QueuedRequest*> ordered;
  ordered.reserve(requests.size());
  for (const QueuedRequest& request : requests) ordered.push_back(&request);
  std::sort(ordered.begin(), ordered.end(), Before);
  if (config.implicit()) {
    for (const QueuedRequest* request : ordered) result.admitted.push_back(request->job_id);
    return result;
  }

  // Queues in ascending fair share, then name: the order of every round.
  std::vector<const QueueSpec*> queues;
  for (const QueueSpec& queue : config.queues) queues.push_back(&queue);
  auto share_of = [&](const QueueSpec* queue) {
    auto it = shares.find(queue->name);
    return it == shares.end() ? 0.0 : it->second;
  };
  std::sort(queues.begin(), queues.end(), [&](const QueueSpec* a, const QueueSpec* b) {
    return std::make_pair(share_of(a), a->name) < std::make_pair(share_of(b), b->name);
  });
  std::map<std::string, size_t> rank;  // queue name -> index in `queues`
  for (size_t i = 0; i < queues.size(); ++i) rank[queues[i]->name] = i;

  // Lanes by [kind][queue rank]; requests stay in queue order since `ordered` is.
  std::vector<Lane> lanes[2];
  for (auto& lane_set : lanes) {
    lane_set.resize(queues.size());
    for (size_t i = 0; i < queues.size(); ++i) lane_set[i].queue = queues[i];
  }
  for (const QueuedRequest* request : ordered) {
    auto it = rank.find(request->queue);
    if (it == rank.end()) {
      result.held[request->job_id] =
          absl::StrCat("queue ", request->queue, " is not configured (any more)");
      continue;
    }
    if (std::optional<std::string> never = QuotaUnsatisfiable(config, *request)) {
      result.held[request->job_id] = *never;
      continue;
    }
    lanes[request->use_gpus ? 0 : 1][it->second].requests.push_back(request);
  }

  QuotaLedger ledger(config, in_use);
  auto admit = [&](Lane& lane, ResourceKind kind) {
    const QueuedRequest* request = lane.requests[lane.next++];
    ledger.Add(*lane.queue, kind, request->devices);
    result.admitted.push_back(request->job_id);
    if (ledger.Used(*lane.queue, kind) > Get(lane.queue->nominal, kind)) {
      result.borrowing.insert(request->job_id);
    }
  };
  auto stop = [&](Lane& lane, std::string reason) {
    lane.stopped = true;
    const QueuedRequest* head = lane.requests[lane.next];
    result.held[head->job_id] = std::move(reason);
    for (size_t i = lane.next + 1; i < lane.requests.size(); ++i) {
      result.held[lane.requests[i]->job_id] =
          absl::StrCat("queue ", lane.queue->name, ": waiting behind ", head->job_id,
                       " (earlier in the queue's priority and age order)");
    }
  };

  for (int k = 0; k < 2; ++k) {
    const ResourceKind kind = kKinds[k];
    std::map<std::string, Reservations> reserved;  // by CohortLabel
    // Nominal round.
    for (Lane& lane : lanes[k]) {
      const QueueSpec& queue = *lane.queue;
      Reservations& kept = reserved[QuotaLedger::CohortLabel(queue)];
      while (lane.next < lane.requests.size()) {
        const QueuedRequest& request = *lane.requests[lane.next];
        if (ledger.Used(queue, kind) + request.devices > Get(queue.nominal, kind)) break;
        if (auto why = ledger.WhyNotFit(queue, kind, request.devices, kept.nominal)) {
          kept.nominal += request.devices;
          stop(lane, *why);
          break;
        }
        admit(lane, kind);
      }
    }
    // Borrowing round: queues of a cohort take turns, lowest share first.
    std::deque<Lane*> turns;
    for (Lane& lane : lanes[k]) {
      if (!lane.stopped && lane.next < lane.requests.size()) turns.push_back(&lane);
    }
    while (!turns.empty()) {
      Lane& lane = *turns.front();
      turns.pop_front();
      const QueueSpec& queue = *lane.queue;
      const QueuedRequest& request = *lane.requests[lane.next];
      Reservations& kept = reserved[QuotaLedger::CohortLabel(queue)];
      // Limits first: a head over its own borrowing limit waits for its own jobs and reserves
      // nothing of the cohort.
      if (auto own = ledger.WhyOverLimit(queue, kind, request.devices)) {
        stop(lane, *own);
        continue;
      }
      std::optional<std::string> why =
          ledger.WhyNotFit(queue, kind, request.devices, kept.nominal + kept.borrow);
      if (!why.has_value()) {
        admit(lane, kind);
        if (lane.next < lane.requests.size()) turns.push_back(&lane);
        continue;
      }
      if (kept.borrow_job.empty()) {
        kept.borrow = request.devices;
        kept.borrow_job = request.job_id;
        kept.borrow_queue = queue.name;
        stop(lane, absl::StrCat(*why, " (it borrows next: the lowest fair share waiting)"));
      } else {
        stop(lane, absl::StrCat(*why, "; ", kept.borrow_job, " of queue ", kept.borrow_queue,
                                " (lower fair share) borrows first"));
      }
    }
  }
  return result;
}

}  // namespace tessera::coordinator
