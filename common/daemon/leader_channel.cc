#include "common/daemon/leader_channel.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/daemon/server.h"

namespace tessera {

absl::StatusOr<std::vector<std::string>> ParseCoordinatorAddresses(const std::string& value,
                                                                   const std::string& field) {
  std::vector<std::string> addresses;
  for (absl::string_view part : absl::StrSplit(value, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (part.empty()) continue;
    const size_t colon = part.rfind(':');
    if (colon == absl::string_view::npos || colon + 1 == part.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": address \"", part, "\" has no port (want host:port)"));
    }
    addresses.emplace_back(part);
  }
  if (addresses.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": no coordinator address (want host:port[,host:port...])"));
  }
  return addresses;
}

LeaderChannel::LeaderChannel(LeaderChannelOptions options) : options_(std::move(options)) {
  if (!options_.addresses.empty()) current_ = options_.addresses.front();
}

std::string LeaderChannel::leader() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

void LeaderChannel::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
}

std::shared_ptr<grpc::Channel> LeaderChannel::ChannelLocked(const std::string& address) {
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (!channel) channel = MakeClientChannel(address, options_.credentials);
  return channel;
}

void LeaderChannel::Observe(const std::string& address, const grpc::ClientContext& context,
                            const grpc::Status& status) {
  // A deadline that passed with several addresses: the coordinator may be paused or its node
  // gone (a connection that hangs rather than being refused); the next call tries the next
  // address, whose standby names the leader if this one still leads.
  const bool hung =
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && options_.addresses.size() > 1;
  if (status.error_code() != grpc::StatusCode::UNAVAILABLE && !hung) return;
  std::string hint;
  const auto& trailers = context.GetServerTrailingMetadata();
  if (auto it = trailers.find(kLeaderMetadataKey); it != trailers.end()) {
    hint.assign(it->second.data(), it->second.size());
  }
  absl::MutexLock lock(&mu_);
  // Another thread may have moved on already; only the address that failed is left behind.
  if (current_ != address) return;
  if (!hint.empty() && hint != address) {
    current_ = hint;
    return;
  }
  const auto& list = options_.addresses;
  if (auto it = std::find(list.begin(), list.end(), address); it != list.end()) {
    next_index_ = static_cast<size_t>(it - list.begin());
  }
  next_index_ = (next_index_ + 1) % list.size();
  current_ = list[next_index_];
}

grpc::Status LeaderChannel::Call(absl::Time deadline,
                                 const std::function<void(grpc::ClientContext&)>& prepare,
                                 const Attempt& attempt) {
  return Call([deadline] { return deadline; }, prepare, attempt);
}

grpc::Status LeaderChannel::Call(const std::function<absl::Time()>& deadline,
                                 const std::function<void(grpc::ClientContext&)>& prepare,
                                 const Attempt& attempt) {
  const size_t round = std::max<size_t>(1, options_.addresses.size());
  // A standby's hint does not count towards the round (the next attempt is the leader), but hints
  // that chase each other (two standbys naming each other) end up counting.
  const size_t max_hints_in_a_row = round + 1;
  absl::Duration backoff = options_.initial_backoff;
  size_t failures_in_round = 0;
  size_t hints_in_a_row = 0;
  // What each address said last, in the order they were first tried (for the final error).
  std::vector<std::pair<std::string, std::string>> tried;
  grpc::Status status;
  while (true) {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) return grpc::Status(grpc::StatusCode::CANCELLED, "shutting down");
      address = current_;
      channel = ChannelLocked(address);
    }
    grpc::ClientContext context;
    prepare(context);
    status = attempt(context, channel, address);
    Observe(address, context, status);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    auto entry = std::find_if(tried.begin(), tried.end(),
                              [&](const auto& said) { return said.first == address; });
    if (entry == tried.end()) entry = tried.insert(tried.end(), {address, ""});
    entry->second = status.error_message();
    const bool hinted =
        leader() != address && context.GetServerTrailingMetadata().count(kLeaderMetadataKey) > 0;
    if (hinted && ++hints_in_a_row <= max_hints_in_a_row) continue;
    hints_in_a_row = 0;
    if (++failures_in_round < round) {
      if (absl::Now() < deadline()) continue;
    } else {
      // One address: the caller's own loop decides when to try again, as before failover existed.
      if (options_.addresses.size() <= 1) break;
      failures_in_round = 0;
      const absl::Time until = std::min(absl::Now() + backoff, deadline());
      backoff = std::min(backoff * 2, options_.max_backoff);
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(&shutdown_), until);
      if (shutdown_) return grpc::Status(grpc::StatusCode::CANCELLED, "shutting down");
      if (absl::Now() < deadline()) continue;
    }
    break;
  }
  if (status.ok() || tried.empty() ||
      (tried.size() == 1 && options_.addresses.size() <= 1 &&
       status.error_code() == grpc::StatusCode::UNAVAILABLE)) {
    return status;
  }
  if (status.error_code() != grpc::StatusCode::UNAVAILABLE &&
      status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
    return status;
  }
  std::vector<std::string> said;
  for (const auto& [address, message] : tried)
    said.push_back(absl::StrCat(address, " (", message, ")"));
  return grpc::Status(status.error_code(),
                      absl::StrCat("no coordinator answered as leader before the deadline; tried ",
                                   absl::StrJoin(said, ", ")));
}

}  // namespace tessera
