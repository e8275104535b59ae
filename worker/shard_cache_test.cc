// The worker's shard cache: the store (put, get, the two-step window, the byte cap's eviction,
// digest mismatch, unknown job), a copy's digest check (once, shared), the ShardCache gRPC
// service between two caches (replication, a peer's lookup, a damaged copy refused), and the
// trainers' Unix socket through the trainer's own client (memory files both ways, unsealed ones
// refused, a peer's copy kept, a corrupt copy never served).
#include "worker/shard_cache.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/scoped_fd.h"
#include "common/socket_frames.h"
#include "common/status_matchers.h"
#include "common/xxh3.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/util/wait.h"
#include "trainer/io/memory_restore.h"
#include "trainer/io/shard_cache_client.h"

namespace tessera::worker {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

v1::ShardHeader Header(const std::string& job, int64_t step, int rank, const std::string& bytes,
                       const std::string& digest = "") {
  v1::ShardHeader header;
  header.mutable_key()->set_job_id(job);
  header.mutable_key()->set_step(step);
  header.mutable_key()->set_rank(rank);
  header.set_xxh3_128(digest.empty() ? absl::StrCat("d-", job, "-", step, "-", rank) : digest);
  header.set_size_bytes(static_cast<int64_t>(bytes.size()));
  header.set_file_name(absl::StrCat("rank-", rank, ".safetensors"));
  return header;
}

v1::ShardKey Key(const std::string& job, int64_t step, int rank) {
  v1::ShardKey key;
  key.set_job_id(job);
  key.set_step(step);
  key.set_rank(rank);
  return key;
}

TEST(ShardCacheStoreTest, PutThenGetReturnsTheBytes) {
  ShardCacheStore store(1 << 20);
  ASSERT_THAT(store.Put(Header("j", 10, 1, "hello"), "hello"), IsOk());
  auto shard = store.Get(Key("j", 10, 1), "d-j-10-1");
  ASSERT_THAT(shard, IsOk());
  EXPECT_EQ((*shard)->bytes.view(), "hello");
  EXPECT_EQ(store.bytes(), 5);
  // Replacing the same key counts its bytes once.
  ASSERT_THAT(store.Put(Header("j", 10, 1, "hey"), "hey"), IsOk());
  EXPECT_EQ(store.bytes(), 3);
  EXPECT_EQ(store.shards(), 1);
}

TEST(ShardCacheStoreTest, UnknownJobStepOrRankIsNotFound) {
  ShardCacheStore store(1 << 20);
  ASSERT_THAT(store.Put(Header("j", 10, 0, "a"), "a"), IsOk());
  EXPECT_THAT(store.Get(Key("other", 10, 0), ""),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("job other")));
  EXPECT_THAT(store.Get(Key("j", 20, 0), ""), StatusIs(absl::StatusCode::kNotFound, HasSubstr("step 20")));
  EXPECT_THAT(store.Get(Key("j", 10, 3), ""), StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank 3")));
}

TEST(ShardCacheStoreTest, DigestMismatchIsFailedPrecondition) {
  ShardCacheStore store(1 << 20);
  ASSERT_THAT(store.Put(Header("j", 10, 0, "a", "aaaa"), "a"), IsOk());
  EXPECT_THAT(store.Get(Key("j", 10, 0), "bbbb"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("aaaa")));
  EXPECT_THAT(store.Get(Key("j", 10, 0), "aaaa"), IsOk());
}

TEST(ShardCacheStoreTest, RefusesIncompleteHeadersNamingTheField) {
  ShardCacheStore store(1 << 20);
  EXPECT_THAT(store.Put(Header("", 1, 0, "a"), "a"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key.job_id")));
  v1::ShardHeader no_digest = Header("j", 1, 0, "a");
  no_digest.clear_xxh3_128();
  EXPECT_THAT(store.Put(no_digest, "a"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("xxh3_128")));
  EXPECT_THAT(store.Put(Header("j", 1, 0, "abc"), "a"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("size_bytes")));
  EXPECT_EQ(store.bytes(), 0);
}

TEST(ShardCacheStoreTest, KeepsTheTwoNewestStepsOfAJob) {
  ShardCacheStore store(1 << 20);
  for (int64_t step : {10, 20, 30}) {
    ASSERT_THAT(store.Put(Header("j", step, 0, "xx"), "xx"), IsOk());
  }
  EXPECT_THAT(store.Get(Key("j", 10, 0), ""), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(store.Get(Key("j", 20, 0), ""), IsOk());
  EXPECT_THAT(store.Get(Key("j", 30, 0), ""), IsOk());
  EXPECT_EQ(store.bytes(), 4);
}

TEST(ShardCacheStoreTest, CapEvictsTheLeastRecentlyPutJobFirst) {
  ShardCacheStore store(10);
  ASSERT_THAT(store.Put(Header("old", 1, 0, "1234"), "1234"), IsOk());
  ASSERT_THAT(store.Put(Header("mid", 1, 0, "1234"), "1234"), IsOk());
  // 12 bytes > 10: "old" goes, "mid" stays.
  ASSERT_THAT(store.Put(Header("new", 1, 0, "1234"), "1234"), IsOk());
  EXPECT_THAT(store.Get(Key("old", 1, 0), ""), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(store.Get(Key("mid", 1, 0), ""), IsOk());
  EXPECT_THAT(store.Get(Key("new", 1, 0), ""), IsOk());
  EXPECT_LE(store.bytes(), 10);
  // A job alone over the cap loses its older step, never the one being put.
  ASSERT_THAT(store.Put(Header("new", 2, 0, "12345678"), "12345678"), IsOk());
  EXPECT_THAT(store.Get(Key("new", 2, 0), ""), IsOk());
  EXPECT_THAT(store.Get(Key("new", 1, 0), ""), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(store.Get(Key("mid", 1, 0), ""), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_EQ(store.bytes(), 8);
  EXPECT_THAT(store.Put(Header("big", 1, 0, "12345678901"), "12345678901"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--shard_cache_bytes")));
}

TEST(ShardCacheStoreTest, DropJobForgetsOnlyThatJob) {
  ShardCacheStore store(1 << 20);
  ASSERT_THAT(store.Put(Header("a", 1, 0, "x"), "x"), IsOk());
  ASSERT_THAT(store.Put(Header("a", 1, 1, "y"), "y"), IsOk());
  ASSERT_THAT(store.Put(Header("b", 1, 0, "z"), "z"), IsOk());
  EXPECT_EQ(store.DropJob("a"), 2);
  EXPECT_EQ(store.DropJob("a"), 0);
  EXPECT_THAT(store.Get(Key("a", 1, 0), ""), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(store.Get(Key("b", 1, 0), ""), IsOk());
  EXPECT_EQ(store.bytes(), 1);
}

// A worker's cache as a peer sees it: a store served over gRPC on loopback.
struct PeerCache {
  explicit PeerCache(int64_t capacity) : store(capacity), service(&store) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  ~PeerCache() { server->Shutdown(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }

  ShardCacheStore store;
  ShardCacheService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

std::string Pattern(size_t size) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(i * 131 + 7);
  return bytes;
}

// A header whose digest is the bytes' own.
v1::ShardHeader TrueHeader(const std::string& job, int64_t step, int rank,
                           const std::string& bytes) {
  return Header(job, step, rank, bytes, Xxh3Hex(bytes));
}

TEST(CachedShardTest, VerifyHashesOnceAndNamesTheShardOnAMismatch) {
  const std::string bytes = Pattern(4096);
  CachedShard good{TrueHeader("j", 1, 0, bytes), *SealedMemory::Copy("test", bytes)};
  EXPECT_THAT(good.Verify(), IsOk());
  EXPECT_THAT(good.Verify(), IsOk());
  CachedShard bad{Header("j", 1, 3, bytes, Xxh3Hex("other")), *SealedMemory::Copy("test", bytes)};
  // Several callers at once (a node's ranks) get the one answer.
  std::vector<absl::Status> answers(4);
  std::vector<std::thread> callers;
  for (absl::Status& answer : answers) callers.emplace_back([&] { answer = bad.Verify(); });
  for (std::thread& caller : callers) caller.join();
  for (const absl::Status& answer : answers) {
    EXPECT_THAT(answer, StatusIs(absl::StatusCode::kDataLoss, HasSubstr("rank-3.safetensors")));
  }
}

TEST(ShardCachePeersTest, PutAndGetAcrossChunks) {
  PeerCache peer(64 << 20);
  ShardCachePeers peers({});
  CachedShard shard{TrueHeader("j", 5, 2, Pattern(3 * kShardChunkBytes + 17)),
                    *SealedMemory::Copy("test", Pattern(3 * kShardChunkBytes + 17))};
  ASSERT_THAT(peers.Put(peer.address(), shard), IsOk());
  EXPECT_EQ(peer.store.bytes(), static_cast<int64_t>(shard.bytes.size()));
  auto fetched = peers.Get(peer.address(), Key("j", 5, 2), shard.header.xxh3_128());
  ASSERT_THAT(fetched, IsOk());
  EXPECT_EQ(fetched->bytes.view(), shard.bytes.view());
  EXPECT_EQ(fetched->header.xxh3_128(), shard.header.xxh3_128());
  // The peer hashed its copy as it arrived.
  auto held = peer.store.Get(Key("j", 5, 2), "");
  ASSERT_THAT(held, IsOk());
  EXPECT_THAT((*held)->Verify(), IsOk());
  EXPECT_THAT(peers.Get(peer.address(), Key("j", 5, 2), "other"),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(peers.Get(peer.address(), Key("unknown", 5, 2), ""),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(peer.address())));
  ASSERT_THAT(peers.DropJob(peer.address(), "j"), IsOk());
  EXPECT_EQ(peer.store.shards(), 0);
}

// A copy that does not hash to its header's digest (damaged on the way) is refused, not kept.
TEST(ShardCachePeersTest, PeerRefusesADamagedCopy) {
  PeerCache peer(64 << 20);
  ShardCachePeers peers({});
  CachedShard shard{Header("j", 5, 1, Pattern(1000), Xxh3Hex("not these bytes")),
                    *SealedMemory::Copy("test", Pattern(1000))};
  EXPECT_THAT(peers.Put(peer.address(), shard),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("rank-1.safetensors")));
  EXPECT_EQ(peer.store.shards(), 0);
}

TEST(ShardCachePeersTest, PeerRefusesAShardLargerThanItsCache) {
  PeerCache peer(100);
  ShardCachePeers peers({});
  CachedShard shard{Header("j", 1, 0, Pattern(200)), *SealedMemory::Copy("test", Pattern(200))};
  EXPECT_THAT(peers.Put(peer.address(), shard),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("size_bytes")));
  EXPECT_EQ(peer.store.shards(), 0);
}

// What a peer that does not follow the protocol gets: an empty stream, a stream that ends short of
// its size, or one with bytes beyond it, each refused with nothing kept; an empty shard is a
// header alone, both ways.
TEST(ShardCachePeersTest, MalformedPutStreamsAreRefusedAndAnEmptyShardRoundTrips) {
  PeerCache peer(64 << 20);
  auto stub = v1::ShardCache::NewStub(
      grpc::CreateChannel(peer.address(), grpc::InsecureChannelCredentials()));
  auto put = [&](const std::vector<v1::PutShardChunk>& chunks) {
    grpc::ClientContext context;
    v1::PutShardResponse response;
    auto writer = stub->Put(&context, &response);
    for (const v1::PutShardChunk& chunk : chunks) {
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  };
  EXPECT_EQ(put({}).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const std::string bytes = Pattern(1000);
  v1::PutShardChunk first;
  *first.mutable_header() = TrueHeader("j", 2, 0, bytes);
  first.set_data(bytes.substr(0, 600));
  grpc::Status short_stream = put({first});
  EXPECT_EQ(short_stream.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_THAT(short_stream.error_message(), HasSubstr("600 bytes, size_bytes says 1000"));
  v1::PutShardChunk rest;
  rest.set_data(bytes.substr(600) + "extra");
  grpc::Status long_stream = put({first, rest});
  EXPECT_EQ(long_stream.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_THAT(long_stream.error_message(), HasSubstr("more bytes than size_bytes 1000"));
  EXPECT_EQ(peer.store.shards(), 0);

  v1::PutShardChunk empty;
  *empty.mutable_header() = TrueHeader("j", 3, 0, "");
  ASSERT_TRUE(put({empty}).ok());
  ShardCachePeers peers({});
  auto fetched = peers.Get(peer.address(), Key("j", 3, 0), "");
  ASSERT_THAT(fetched, IsOk());
  EXPECT_EQ(fetched->bytes.size(), 0u);
  EXPECT_EQ(fetched->header.xxh3_128(), Xxh3Hex(""));
}

std::string SocketPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          absl::StrCat("tessera-shard-cache-test-", getpid(), "-", name, ".sock"))
      .string();
}

// The trainer's put lands in its worker's store and is replicated to the peer; a get for a shard
// this worker lacks is answered from the peer named in the request.
TEST(LocalShardCacheServerTest, PutReplicatesAndGetFallsBackToPeers) {
  PeerCache peer(64 << 20);
  ShardCacheStore store(64 << 20);
  ShardCachePeers peers({});
  const std::string socket = SocketPath("a");
  auto server = LocalShardCacheServer::Start(socket, &store, &peers, nullptr);
  ASSERT_THAT(server, IsOk());
  const std::string bytes = Pattern(2 * kShardChunkBytes + 5);
  const std::string digest = Xxh3Hex(bytes);
  auto put = SealedMemory::Copy("test", bytes);
  ASSERT_THAT(put, IsOk());
  ASSERT_THAT(trainer::PutShardInCache(socket, TrueHeader("j", 7, 0, bytes), *put, peer.address()),
              IsOk());
  EXPECT_EQ(store.bytes(), static_cast<int64_t>(bytes.size()));
  // The worker keeps the trainer's memory file: the same pages, not a copy.
  struct stat handed {
  }, kept{};
  ASSERT_EQ(::fstat(put->fd(), &handed), 0);
  ASSERT_EQ(::fstat((*store.Get(Key("j", 7, 0), ""))->bytes.fd(), &kept), 0);
  EXPECT_EQ(handed.st_ino, kept.st_ino);
  EXPECT_TRUE(testing::WaitUntil([&] { return peers.replicated() != 0; }, absl::Seconds(2),
                                 absl::Milliseconds(10)));
  EXPECT_EQ(peers.replicated(), 1);
  EXPECT_THAT(peer.store.Get(Key("j", 7, 0), digest), IsOk());

  auto local = trainer::GetShardFromCache(socket, Key("j", 7, 0), digest, {});
  ASSERT_THAT(local, IsOk());
  EXPECT_EQ(local->bytes.view(), bytes);
  EXPECT_TRUE(local->verified);
  // The trainer maps the worker's own memory file: the same pages, not a copy.
  struct stat mine {}, theirs {};
  ASSERT_EQ(::fstat(local->bytes.fd(), &mine), 0);
  ASSERT_EQ(::fstat((*store.Get(Key("j", 7, 0), ""))->bytes.fd(), &theirs), 0);
  EXPECT_EQ(mine.st_ino, theirs.st_ino);
  EXPECT_EQ(mine.st_dev, theirs.st_dev);
  EXPECT_EQ(local->source, v1::SHARD_SOURCE_LOCAL);

  // This worker lost its copy (a restarted worker): the peer's answers, and this worker keeps
  // it, so the node's next rank asking finds it here.
  store.DropJob("j");
  auto remote =
      trainer::GetShardFromCache(socket, Key("j", 7, 0), digest, {"127.0.0.1:1", peer.address()});
  ASSERT_THAT(remote, IsOk());
  EXPECT_EQ(remote->bytes.view(), bytes);
  EXPECT_EQ(remote->source, v1::SHARD_SOURCE_PEER);
  EXPECT_TRUE(remote->verified);
  auto again = trainer::GetShardFromCache(socket, Key("j", 7, 0), digest, {peer.address()});
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->source, v1::SHARD_SOURCE_LOCAL);
  EXPECT_EQ(again->bytes.view(), bytes);

  EXPECT_THAT(trainer::GetShardFromCache(socket, Key("j", 7, 0), "wrong", {peer.address()}),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(trainer::GetShardFromCache(socket, Key("nope", 7, 0), "", {}),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

// A copy whose bytes are not those its digest names (a trainer's put gone wrong) is never
// served; a peer's good copy is served instead.
TEST(LocalShardCacheServerTest, ACorruptCopyIsNeverServed) {
  PeerCache peer(64 << 20);
  ShardCacheStore store(64 << 20);
  ShardCachePeers peers({});
  const std::string socket = SocketPath("corrupt");
  auto server = LocalShardCacheServer::Start(socket, &store, &peers, nullptr);
  ASSERT_THAT(server, IsOk());
  const std::string bytes = Pattern(5000);
  std::string corrupt = bytes;
  corrupt[99] ^= 4;
  ASSERT_THAT(store.Put(TrueHeader("j", 3, 1, bytes), corrupt), IsOk());
  EXPECT_THAT(trainer::GetShardFromCache(socket, Key("j", 3, 1), Xxh3Hex(bytes), {}),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("rank-1.safetensors")));
  ASSERT_THAT(peer.store.Put(TrueHeader("j", 3, 1, bytes), bytes), IsOk());
  auto served =
      trainer::GetShardFromCache(socket, Key("j", 3, 1), Xxh3Hex(bytes), {peer.address()});
  ASSERT_THAT(served, IsOk());
  EXPECT_EQ(served->source, v1::SHARD_SOURCE_PEER);
  EXPECT_EQ(served->bytes.view(), bytes);
}

// A put's memory file must be sealed: bytes the trainer could still change are not kept.
TEST(LocalShardCacheServerTest, AnUnsealedMemoryFileIsRefused) {
  ShardCacheStore store(64 << 20);
  ShardCachePeers peers({});
  const std::string socket = SocketPath("unsealed");
  auto server = LocalShardCacheServer::Start(socket, &store, &peers, nullptr);
  ASSERT_THAT(server, IsOk());
  const std::string bytes = Pattern(100);
  ScopedFd memory(::memfd_create("unsealed", MFD_CLOEXEC));
  ASSERT_GE(memory.get(), 0);
  ASSERT_EQ(::write(memory.get(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  ScopedFd client(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket.data(), socket.size());
  ASSERT_EQ(::connect(client.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  v1::ShardCacheRequest request;
  request.set_op(v1::SHARD_CACHE_OP_PUT);
  *request.mutable_header() = TrueHeader("j", 1, 0, bytes);
  ASSERT_TRUE(WriteMessage(client.get(), request));
  ASSERT_TRUE(SendDescriptor(client.get(), memory.get()));
  v1::ShardCacheResponse response;
  ASSERT_TRUE(ReadMessage(client.get(), 1 << 20, &response));
  EXPECT_EQ(response.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition))
      << response.message();
  EXPECT_EQ(store.shards(), 0);
}

TEST(LocalShardCacheServerTest, UnreachableWorkerIsUnavailableNamingTheSocket) {
  const std::string socket = SocketPath("missing");
  EXPECT_THAT(trainer::GetShardFromCache(socket, Key("j", 1, 0), "", {}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr(socket)));
}

// The trainer's restore from memory (trainer/io/memory_restore.h) against a real local socket: a
// copy is used only when its bytes hash to the manifest's digest; a missing shard is NOT_FOUND.
class MemoryRestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto started = LocalShardCacheServer::Start(socket_, &store_, &peers_, nullptr);
    ASSERT_THAT(started, IsOk());
    server_ = *std::move(started);
    task_.set_job_id("job");
    task_.set_shard_cache_socket(socket_);
    manifest_.set_step(30);
    for (int rank : {0, 1}) {
      v1::CheckpointShard* shard = manifest_.add_shards();
      shard->set_rank(rank);
      shard->set_file(absl::StrCat("rank-0000", rank, ".safetensors"));
      shard->set_size_bytes(static_cast<int64_t>(Bytes(rank).size()));
      shard->set_xxh3_128(Xxh3Hex(Bytes(rank)));
    }
  }
  static std::string Bytes(int rank) { return Pattern(1000 + rank); }
  // What rank `rank`'s trainer hands over after writing its shard.
  void Hand(int rank, const std::string& bytes, const std::string& digest) {
    auto memory = SealedMemory::Copy("test", bytes);
    ASSERT_THAT(memory, IsOk());
    ASSERT_THAT(
        trainer::HandShardToCache(task_, 30, rank, manifest_.shards(rank).file(), digest, *memory),
        IsOk());
  }

  std::string socket_ = SocketPath("restore");
  ShardCacheStore store_{64 << 20};
  ShardCachePeers peers_{{}};
  std::unique_ptr<LocalShardCacheServer> server_;
  v1::TrainerTask task_;
  v1::CheckpointManifest manifest_;
};

TEST_F(MemoryRestoreTest, EveryShardFromMemoryIsMappedInManifestOrder) {
  Hand(0, Bytes(0), Xxh3Hex(Bytes(0)));
  Hand(1, Bytes(1), Xxh3Hex(Bytes(1)));
  auto copy = trainer::FetchCheckpointFromMemory(task_, manifest_);
  ASSERT_THAT(copy, IsOk());
  EXPECT_EQ(copy->shards_from_peers, 0);
  // The worker had hashed every copy: the rank hashed none itself.
  EXPECT_EQ(copy->verify_seconds, 0);
  ASSERT_EQ(copy->shards.size(), 2u);
  const std::vector<std::string> paths = copy->ShardPaths();
  for (int rank : {0, 1}) {
    EXPECT_EQ(copy->shards[rank].view(), Bytes(rank));
    // What a reader opening the path reads.
    std::ifstream in(paths[rank], std::ios::binary);
    std::string read((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(read, Bytes(rank));
  }
}

TEST_F(MemoryRestoreTest, AMissingShardIsNotFound) {
  Hand(0, Bytes(0), Xxh3Hex(Bytes(0)));
  EXPECT_THAT(trainer::FetchCheckpointFromMemory(task_, manifest_),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("rank 1")));
}

TEST_F(MemoryRestoreTest, ACorruptCopyIsDataLossNamingTheShard) {
  Hand(0, Bytes(0), Xxh3Hex(Bytes(0)));
  // The worker holds bytes that are not those its digest (the manifest's) describes.
  std::string corrupt = Bytes(1);
  corrupt[17] ^= 1;
  Hand(1, corrupt, Xxh3Hex(Bytes(1)));
  EXPECT_THAT(trainer::FetchCheckpointFromMemory(task_, manifest_),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("rank-00001.safetensors")));
}

TEST_F(MemoryRestoreTest, ACopyOfAnotherCheckpointIsNotUsed) {
  Hand(0, Bytes(0), Xxh3Hex(Bytes(0)));
  Hand(1, Bytes(0), Xxh3Hex(Bytes(0)));
  EXPECT_THAT(trainer::FetchCheckpointFromMemory(task_, manifest_),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
}

}  // namespace
}  // namespace tessera::worker
