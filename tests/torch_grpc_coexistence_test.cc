// LibTorch and gRPC/Protobuf in one process: the torch wheel links its own
// protobuf statically with hidden symbols, so Debian's protobuf and gRPC can
// share the process. This test keeps that true: a gRPC handler runs a LibTorch
// computation and answers with a protobuf message, over TCP.

#include <memory>

#include "common/daemon/server.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tessera/v1/worker_service.grpc.pb.h"
#include "trainer/torch_pch.h"

namespace tessera {
namespace {

using ::tessera::testing::IsOk;

// GetNode answers with memory_bytes computed by LibTorch inside the handler.
class TorchBackedWorker final : public v1::Worker::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetNode(grpc::CallbackServerContext* context, const v1::GetNodeRequest*,
                                    v1::GetNodeResponse* response) override {
    torch::Tensor a = torch::arange(1, 65, torch::kFloat64).reshape({8, 8});
    torch::Tensor trace = torch::matmul(a, a.t()).trace();
    response->mutable_node()->mutable_resources()->set_memory_bytes(trace.item<int64_t>());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

TEST(TorchGrpcCoexistenceTest, HandlerRunsLibTorchAndRepliesOverGrpc) {
  TorchBackedWorker service;
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"},
                                  {{v1::Worker::service_full_name(), &service}});
  ASSERT_THAT(server, IsOk());
  auto stub = v1::Worker::NewStub(MakeClientChannel((*server)->address()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetNodeResponse response;
  grpc::Status status = stub->GetNode(&context, {}, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  // trace(A A^T) is the sum of squares of 1..64 = 64*65*129/6.
  EXPECT_EQ(response.node().resources().memory_bytes(), 64 * 65 * 129 / 6);
}

TEST(TorchGrpcCoexistenceTest, ProtobufDescriptorPoolIsOurs) {
  // Torch's private protobuf registers onnx messages in its own pool; the
  // process's generated pool holds only ours and protobuf's well-known types.
  const auto* pool = google::protobuf::DescriptorPool::generated_pool();
  EXPECT_EQ(v1::GetNodeResponse::descriptor()->file()->pool(), pool);
  EXPECT_NE(pool->FindMessageTypeByName("tessera.v1.GetNodeResponse"), nullptr);
  EXPECT_EQ(pool->FindMessageTypeByName("onnx_torch.ModelProto"), nullptr);
}

}  // namespace
}  // namespace tessera
