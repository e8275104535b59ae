#include "worker/shard_cache.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/daemon/grpc_status.h"
#include "common/security/tls.h"
#include "common/xxh3.h"

namespace tessera::worker {
namespace {

std::string KeyText(const v1::ShardKey& key) {
  return absl::StrCat(key.job_id(), " step ", key.step(), " rank ", key.rank());
}

absl::Status CheckHeader(const v1::ShardHeader& header, size_t size) {
  if (header.key().job_id().empty()) return absl::InvalidArgumentError("key.job_id: required");
  if (header.key().step() < 0) return absl::InvalidArgumentError("key.step: negative");
  if (header.key().rank() < 0) return absl::InvalidArgumentError("key.rank: negative");
  if (header.xxh3_128().empty()) return absl::InvalidArgumentError("xxh3_128: required");
  if (header.size_bytes() != static_cast<int64_t>(size)) {
    return absl::InvalidArgumentError(absl::StrCat("size_bytes: ", header.size_bytes(),
                                                   ", but the shard has ", size, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CachedShard::DigestStatus(const std::string& digest) const {
  if (digest == header.xxh3_128()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "shard cache: the copy of ", header.file_name(), " (", KeyText(header.key()), ", ",
      bytes.size(), " bytes) hashes to xxh3-128 ", digest, ", not its ", header.xxh3_128()));
}

absl::Status CachedShard::Verify() const {
  absl::call_once(digest_check->once,
                  [this] { digest_check->status = DigestStatus(Xxh3Hex(bytes.view())); });
  return digest_check->status;
}

void CachedShard::SetDigest(const std::string& xxh3_128) const {
  absl::call_once(digest_check->once, [&] { digest_check->status = DigestStatus(xxh3_128); });
}

absl::Status ShardCacheStore::Put(v1::ShardHeader header, std::string_view bytes) {
  if (absl::Status status = CheckHeader(header, bytes.size()); !status.ok()) return status;
  absl::StatusOr<SealedMemory> copy = SealedMemory::Copy("tessera-shard", bytes);
  if (!copy.ok()) return copy.status();
  return Put(std::move(header), *std::move(copy));
}

absl::Status ShardCacheStore::Put(v1::ShardHeader header, SealedMemory bytes) {
  auto shard = std::make_shared<CachedShard>();
  shard->header = std::move(header);
  shard->bytes = std::move(bytes);
  return Put(std::shared_ptr<const CachedShard>(std::move(shard)));
}

absl::Status ShardCacheStore::Put(std::shared_ptr<const CachedShard> shard) {
  const v1::ShardHeader& header = shard->header;
  if (absl::Status status = CheckHeader(header, shard->bytes.size()); !status.ok()) return status;
  const int64_t size = static_cast<int64_t>(shard->bytes.size());
  if (size > capacity_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shard ", KeyText(header.key()), " has ", size,
                     " bytes, more than the whole cache (--shard_cache_bytes ", capacity_bytes_,
                     ")"));
  }
  const std::string job_id = header.key().job_id();
  const int64_t step = header.key().step();
  const int rank = header.key().rank();
  absl::MutexLock lock(&mu_);
  Job& job = jobs_[job_id];
  job.last_put = ++puts_;
  auto& slot = job.steps[step][rank];
  if (slot != nullptr) bytes_ -= static_cast<int64_t>(slot->bytes.size());
  slot = std::move(shard);
  bytes_ += size;
  // Two steps: the one arriving, whose manifest may not be committed yet, and the one before,
  // which a restart now would resume.
  while (job.steps.size() > 2) DropStepLocked(job, job.steps.begin()->first);
  while (bytes_ > capacity_bytes_) {
    auto victim = jobs_.end();
    for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
      if (it->first == job_id) continue;
      if (victim == jobs_.end() || it->second.last_put < victim->second.last_put) victim = it;
    }
    if (victim != jobs_.end()) {
      while (!victim->second.steps.empty()) {
        DropStepLocked(victim->second, victim->second.steps.begin()->first);
      }
      jobs_.erase(victim);
      continue;
    }
    // Only this job is left: its older step goes (never the step being put).
    if (job.steps.size() < 2) break;
    DropStepLocked(job, job.steps.begin()->first);
  }
  return absl::OkStatus();
}

void ShardCacheStore::DropStepLocked(Job& job, int64_t step) {
  auto it = job.steps.find(step);
  if (it == job.steps.end()) return;
  for (const auto& [rank, shard] : it->second) bytes_ -= static_cast<int64_t>(shard->bytes.size());
  job.steps.erase(it);
}

absl::StatusOr<std::shared_ptr<const CachedShard>> ShardCacheStore::Get(
    const v1::ShardKey& key, const std::string& want_xxh3_128) const {
  absl::MutexLock lock(&mu_);
  auto job = jobs_.find(key.job_id());
  if (job == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("shard cache: no shards of job ", key.job_id()));
  }
  auto step = job->second.steps.find(key.step());
  if (step == job->second.steps.end()) {
    return absl::NotFoundError(absl::StrCat("shard cache: no shards of ", key.job_id(),
                                            " step ", key.step()));
  }
  auto shard = step->second.find(key.rank());
  if (shard == step->second.end()) {
    return absl::NotFoundError(absl::StrCat("shard cache: no shard ", KeyText(key)));
  }
  if (!want_xxh3_128.empty() && shard->second->header.xxh3_128() != want_xxh3_128) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard cache: ", KeyText(key), " holds xxh3-128 ",
                     shard->second->header.xxh3_128(), ", not ", want_xxh3_128));
  }
  return shard->second;
}

int ShardCacheStore::DropJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return 0;
  int dropped = 0;
  while (!it->second.steps.empty()) {
    dropped += static_cast<int>(it->second.steps.begin()->second.size());
    DropStepLocked(it->second, it->second.steps.begin()->first);
  }
  jobs_.erase(it);
  return dropped;
}

int64_t ShardCacheStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

int ShardCacheStore::shards() const {
  absl::MutexLock lock(&mu_);
  int count = 0;
  for (const auto& [id, job] : jobs_) {
    for (const auto& [step, ranks] : job.steps) count += static_cast<int>(ranks.size());
  }
  return count;
}

int64_t DefaultShardCacheBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string name;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> name >> kib >> unit) {
    if (name == "MemTotal:") return kib * 1024 / 4;
  }
  return int64_t{1} << 30;
}

// --- gRPC service -------------------------------------------------------------------------------

grpc::Status ShardCacheService::CheckCaller(const grpc::ServerContextBase& context) const {
  return CheckCallerAllowed(context, allowed_callers_, "--shard_cache_allowed_callers");
}

namespace {

// One Put stream: the header chunk sizes the memory file, every chunk's bytes go straight into it
// and into the hash as they arrive, and the end of the stream seals the file and stores the shard.
class PutReactor final : public grpc::ServerReadReactor<v1::PutShardChunk> {
 public:
  PutReactor(ShardCacheStore* store, grpc::CallbackServerContext* context,
             v1::PutShardResponse* response, const grpc::Status& caller)
      : store_(store), context_(context), response_(response) {
    if (!caller.ok()) {
      Finish(caller);
      return;
    }
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the end of the stream, or a broken one
      Finish(End());
      return;
    }
    if (absl::Status status = Take(); !status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    StartRead(&chunk_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Take() {
    if (!writer_.has_value()) {
      header_ = chunk_.header();
      if (header_.size_bytes() < 0 || header_.size_bytes() > store_->capacity_bytes()) {
        return absl::ResourceExhaustedError(absl::StrCat("size_bytes: ", header_.size_bytes(),
                                                         " does not fit the cache (",
                                                         store_->capacity_bytes(), " bytes)"));
      }
      absl::StatusOr<SealedMemory::Writer> writer =
          SealedMemory::Writer::Start("tessera-shard", static_cast<size_t>(header_.size_bytes()));
      if (!writer.ok()) return writer.status();
      absl::StatusOr<Xxh3Hasher> hasher = Xxh3Hasher::Create();
      if (!hasher.ok()) return hasher.status();
      writer_.emplace(*std::move(writer));
      hasher_.emplace(*std::move(hasher));
    }
    const std::string& data = chunk_.data();
    if (data.size() > writer_->size() - received_) {
      return absl::DataLossError(absl::StrCat("shard ", KeyText(header_.key()),
                                              ": more bytes than size_bytes ", writer_->size()));
    }
    if (!data.empty()) {
      std::memcpy(writer_->data() + received_, data.data(), data.size());
      hasher_->Update(data.data(), data.size());
    }
    received_ += data.size();
    return absl::OkStatus();
  }

  grpc::Status End() {
    if (context_->IsCancelled()) return grpc::Status::CANCELLED;
    if (!writer_.has_value()) {
      return ToGrpcStatus(absl::InvalidArgumentError("header: the stream was empty"));
    }
    if (received_ != writer_->size()) {
      return ToGrpcStatus(
          absl::DataLossError(absl::StrCat("shard ", KeyText(header_.key()), ": ", received_,
                                           " bytes, size_bytes says ", writer_->size())));
    }
    absl::StatusOr<SealedMemory> bytes = std::move(*writer_).Seal();
    if (!bytes.ok()) return ToGrpcStatus(bytes.status());
    auto shard = std::make_shared<CachedShard>();
    shard->header = std::move(header_);
    shard->bytes = *std::move(bytes);
    // Hashed as it arrived: a copy the network damaged is refused (the sender logs it), and one
    // kept is served to this node's trainers without hashing it again.
    shard->SetDigest(hasher_->HexDigest());
    absl::Status status = shard->Verify();
    if (status.ok()) status = store_->Put(std::move(shard));
    if (!status.ok()) return ToGrpcStatus(status);
    response_->set_cache_bytes(store_->bytes());
    return grpc::Status::OK;
  }

  ShardCacheStore* const store_;
  grpc::CallbackServerContext* const context_;
  v1::PutShardResponse* const response_;
  v1::PutShardChunk chunk_;
  v1::ShardHeader header_;
  std::optional<SealedMemory::Writer> writer_;
  std::optional<Xxh3Hasher> hasher_;
  size_t received_ = 0;
};

// One Get stream: the shard's bytes in chunks of kShardChunkBytes (the header with the first; one
// chunk for an empty shard), each written once the previous one was taken.
class GetReactor final : public grpc::ServerWriteReactor<v1::GetShardChunk> {
 public:
  explicit GetReactor(absl::StatusOr<std::shared_ptr<const CachedShard>> shard)
      : shard_(shard.ok() ? *shard : nullptr) {
    if (!shard.ok()) {
      Finish(ToGrpcStatus(shard.status()));
      return;
    }
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::CANCELLED);
    } else if (offset_ >= shard_->bytes.size()) {
      Finish(grpc::Status::OK);
    } else {
      WriteNext();
    }
  }

  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    const std::string_view bytes = shard_->bytes.view();
    chunk_.Clear();
    if (offset_ == 0) *chunk_.mutable_header() = shard_->header;
    const size_t n = std::min(kShardChunkBytes, bytes.size() - offset_);
    chunk_.set_data(bytes.data() + offset_, n);
    offset_ += n;
    StartWrite(&chunk_);
  }

  const std::shared_ptr<const CachedShard> shard_;
  v1::GetShardChunk chunk_;
  size_t offset_ = 0;
};

}  // namespace

grpc::ServerReadReactor<v1::PutShardChunk>* ShardCacheService::Put(
    grpc::CallbackServerContext* context, v1::PutShardResponse* response) {
  return new PutReactor(store_, context, response, CheckCaller(*context));
}

grpc::ServerWriteReactor<v1::GetShardChunk>* ShardCacheService::Get(
    grpc::CallbackServerContext* context, const v1::GetShardRequest* request) {
  if (grpc::Status status = CheckCaller(*context); !status.ok()) {
    return new GetReactor(
        absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message()));
  }
  return new GetReactor(store_->Get(request->key(), request->xxh3_128()));
}

grpc::ServerUnaryReactor* ShardCacheService::DropJob(grpc::CallbackServerContext* context,
                                                     const v1::DropJobRequest* request,
                                                     v1::DropJobResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status status = CheckCaller(*context);
  if (status.ok() && request->job_id().empty()) {
    status = ToGrpcStatus(absl::InvalidArgumentError("job_id: required"));
  }
  if (status.ok()) response->set_shards(store_->DropJob(request->job_id()));
  reactor->Finish(status);
  return reactor;
}

// --- peers --------------------------------------------------------------------------------------

ShardCachePeers::ShardCachePeers(ShardCachePeersOptions options)
    : options_(std::move(options)), sender_([this] { SendLoop(); }) {}

ShardCachePeers::~ShardCachePeers() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  sender_.join();
}

std::shared_ptr<grpc::Channel> ShardCachePeers::ChannelTo(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(static_cast<int>(2 * kShardChunkBytes));
    channel = grpc::CreateCustomChannel(address, options_.credentials, args);
  }
  return channel;
}

namespace {

std::chrono::system_clock::time_point DeadlineFor(absl::Duration base, int64_t bytes) {
  const absl::Duration timeout = base + absl::Seconds(bytes >> 20) / 10;
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
}

}  // namespace

absl::Status ShardCachePeers::Put(const std::string& address, const CachedShard& shard) {
  v1::ShardCache::Stub stub(ChannelTo(address));
  grpc::ClientContext context;
  context.set_deadline(DeadlineFor(options_.call_timeout, shard.header.size_bytes()));
  v1::PutShardResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::PutShardChunk>> writer =
      stub.Put(&context, &response);
  size_t offset = 0;
  do {
    v1::PutShardChunk chunk;
    if (offset == 0) *chunk.mutable_header() = shard.header;
    const size_t n = std::min(kShardChunkBytes, shard.bytes.size() - offset);
    chunk.set_data(shard.bytes.data() + offset, n);
    offset += n;
    if (!writer->Write(chunk)) break;
  } while (offset < shard.bytes.size());
  writer->WritesDone();
  absl::Status status = FromGrpcStatus(writer->Finish());
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat("shard cache put ",
                                                    KeyText(shard.header.key()), " to ", address,
                                                    ": ", status.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<CachedShard> ShardCachePeers::Get(const std::string& address,
                                                 const v1::ShardKey& key,
                                                 const std::string& want_xxh3_128) {
  v1::ShardCache::Stub stub(ChannelTo(address));
  grpc::ClientContext context;
  // The size is unknown before the header: a deadline for a large shard.
  context.set_deadline(DeadlineFor(options_.call_timeout, int64_t{64} << 30));
  v1::GetShardRequest request;
  *request.mutable_key() = key;
  request.set_xxh3_128(want_xxh3_128);
  std::unique_ptr<grpc::ClientReader<v1::GetShardChunk>> reader = stub.Get(&context, request);
  const std::string what = absl::StrCat("shard cache get ", KeyText(key), " from ", address);
  CachedShard shard;
  v1::GetShardChunk chunk;
  absl::Status received = absl::OkStatus();
  if (reader->Read(&chunk)) {
    shard.header = chunk.header();
    if (shard.header.size_bytes() < 0) {
      context.TryCancel();
      received = absl::DataLossError(absl::StrCat(what, ": negative size_bytes"));
    } else {
      // The chunks go straight into one memory file of the announced size.
      const size_t size = static_cast<size_t>(shard.header.size_bytes());
      absl::StatusOr<SealedMemory> bytes =
          SealedMemory::Create("tessera-shard", size, [&](char* data) -> absl::Status {
            size_t got = 0;
            do {
              if (chunk.data().size() > size - got) {
                context.TryCancel();
                return absl::DataLossError(
                    absl::StrCat(what, ": more bytes than the header's ", size));
              }
              if (!chunk.data().empty()) {
                std::memcpy(data + got, chunk.data().data(), chunk.data().size());
              }
              got += chunk.data().size();
            } while (reader->Read(&chunk));
            if (got != size) {
              return absl::DataLossError(
                  absl::StrCat(what, ": ", got, " bytes, header says ", size));
            }
            return absl::OkStatus();
          });
      if (bytes.ok()) {
        shard.bytes = *std::move(bytes);
      } else {
        received = bytes.status();
      }
    }
  }
  while (!received.ok() && reader->Read(&chunk)) {
  }
  absl::Status status = FromGrpcStatus(reader->Finish());
  // The peer's error explains a short stream better than the count does; a cancel is ours.
  if (!status.ok() && !(absl::IsCancelled(status) && !received.ok())) {
    return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
  }
  if (!received.ok()) return received;
  if (shard.bytes.fd() < 0) return absl::DataLossError(absl::StrCat(what, ": no header came"));
  return shard;
}

absl::Status ShardCachePeers::DropJob(const std::string& address, const std::string& job_id) {
  v1::ShardCache::Stub stub(ChannelTo(address));
  grpc::ClientContext context;
  context.set_deadline(DeadlineFor(options_.call_timeout, 0));
  v1::DropJobRequest request;
  request.set_job_id(job_id);
  v1::DropJobResponse response;
  return FromGrpcStatus(stub.DropJob(&context, request, &response));
}

void ShardCachePeers::Replicate(const std::string& address,
                                std::shared_ptr<const CachedShard> shard) {
  absl::MutexLock lock(&mu_);
  queue_.emplace_back(address, std::move(shard));
  while (static_cast<int>(queue_.size()) > options_.max_queued) {
    std::cerr << "tessera-worker: shard cache: replication to " << queue_.front().first
              << " of " << KeyText(queue_.front().second->header.key())
              << " dropped (the peer is slower than the checkpoints)" << std::endl;
    queue_.pop_front();
    ++replication_failures_;
  }
}

void ShardCachePeers::SendLoop() {
  while (true) {
    std::pair<std::string, std::shared_ptr<const CachedShard>> next;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      next = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::Status status = Put(next.first, *next.second);
    absl::MutexLock lock(&mu_);
    if (status.ok()) {
      ++replicated_;
    } else {
      ++replication_failures_;
      std::cerr << "tessera-worker: shard cache: replication failed: " << status << std::endl;
    }
  }
}

int64_t ShardCachePeers::replicated() const {
  absl::MutexLock lock(&mu_);
  return replicated_;
}

int64_t ShardCachePeers::replication_failures() const {
  absl::MutexLock lock(&mu_);
  return replication_failures_;
}

// --- metrics ------------------------------------------------------------------------------------

ShardCacheMetrics::ShardCacheMetrics(prometheus::Registry& registry) {
  auto& restores = prometheus::BuildCounter()
                       .Name("tessera_checkpoint_restores_total")
                       .Help("Checkpoint restores of this node's trainers, by where the "
                             "checkpoint was read from (memory: workers' shard caches)")
                       .Register(registry);
  memory_ = &restores.Add({{"source", "memory"}});
  storage_ = &restores.Add({{"source", "storage"}});
  cache_bytes_ = &prometheus::BuildGauge()
                      .Name("tessera_shard_cache_bytes")
                      .Help("Checkpoint shard bytes this worker holds in memory, as of its trainers' last put")
                      .Register(registry)
                      .Add({});
}

void ShardCacheMetrics::RecordReport(const v1::TrainerReport& report) {
  if (!report.has_started() || !report.started().has_restore()) return;
  switch (report.started().restore().source()) {
    case v1::RESTORE_SOURCE_MEMORY:
      memory_->Increment();
      break;
    case v1::RESTORE_SOURCE_STORAGE:
      storage_->Increment();
      break;
    default:
      break;
  }
}

}  // namespace tessera::worker
