// Checks the v1 contract itself: every message, field, oneof, enum, enum
// value, service and method of package tessera.v1 carries a comment; names
// follow the style guide; and the generated C++ matches the .proto files.

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.pb.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera {
namespace {

using google::protobuf::DescriptorProto;
using google::protobuf::EnumDescriptorProto;
using google::protobuf::FileDescriptorProto;
using google::protobuf::FileDescriptorSet;

// Field numbers of descriptor.proto used to build SourceCodeInfo paths.
constexpr int kFileMessageType = 4;
constexpr int kFileEnumType = 5;
constexpr int kFileService = 6;
constexpr int kMessageField = 2;
constexpr int kMessageNestedType = 3;
constexpr int kMessageEnumType = 4;
constexpr int kMessageOneofDecl = 8;
constexpr int kEnumValue = 2;
constexpr int kServiceMethod = 2;

FileDescriptorSet LoadDescriptorSet() {
  // Written by the build next to the generated code (proto/CMakeLists.txt).
  const char* path = TESSERA_DESCRIPTOR_SET;
  FileDescriptorSet set;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  EXPECT_TRUE(set.ParseFromIstream(&in)) << "cannot parse " << path;
  return set;
}

std::vector<FileDescriptorProto> TesseraFiles(const FileDescriptorSet& set) {
  std::vector<FileDescriptorProto> files;
  for (const auto& file : set.file()) {
    if (file.package() == "tessera.v1") files.push_back(file);
  }
  return files;
}

// Walks a file and reports every element without a leading or trailing comment.
class DocChecker {
 public:
  explicit DocChecker(const FileDescriptorProto& file) : file_(file) {
    for (const auto& location : file.source_code_info().location()) {
      std::vector<int> path(location.path().begin(), location.path().end());
      std::string comment = location.leading_comments() + location.trailing_comments();
      if (!comment.empty()) documented_[path] = comment;
    }
  }

  std::vector<std::string> Undocumented() {
    for (int i = 0; i < file_.message_type_size(); ++i) {
      CheckMessage(file_.message_type(i), {kFileMessageType, i}, file_.package());
    }
    for (int i = 0; i < file_.enum_type_size(); ++i) {
      CheckEnum(file_.enum_type(i), {kFileEnumType, i}, file_.package());
    }
    for (int i = 0; i < file_.service_size(); ++i) {
      const auto& service = file_.service(i);
      std::string name = file_.package() + "." + service.name();
      Require({kFileService, i}, name);
      for (int m = 0; m < service.method_size(); ++m) {
        Require({kFileService, i, kServiceMethod, m}, name + "." + service.method(m).name());
      }
    }
    return missing_;
  }

 private:
  void CheckMessage(const DescriptorProto& message, std::vector<int> path,
                    const std::string& scope) {
    std::string name = scope + "." + message.name();
    Require(path, name);
    for (int f = 0; f < message.field_size(); ++f) {
      Require(Append(path, {kMessageField, f}), name + "." + message.field(f).name());
    }
    for (int o = 0; o < message.oneof_decl_size(); ++o) {
      // proto3 `optional` fields get a synthetic oneof named "_<field>".
      if (message.oneof_decl(o).name().starts_with("_")) continue;
      Require(Append(path, {kMessageOneofDecl, o}), name + "." + message.oneof_decl(o).name());
    }
    for (int n = 0; n < message.nested_type_size(); ++n) {
      if (message.nested_type(n).options().map_entry()) continue;
      CheckMessage(message.nested_type(n), Append(path, {kMessageNestedType, n}), name);
    }
    for (int e = 0; e < message.enum_type_size(); ++e) {
      CheckEnum(message.enum_type(e), Append(path, {kMessageEnumType, e}), name);
    }
  }

  void CheckEnum(const EnumDescriptorProto& enumeration, std::vector<int> path,
                 const std::string& scope) {
    std::string name = scope + "." + enumeration.name();
    Require(path, name);
    for (int v = 0; v < enumeration.value_size(); ++v) {
      Require(Append(path, {kEnumValue, v}), name + "." + enumeration.value(v).name());
    }
  }

  static std::vector<int> Append(std::vector<int> path, std::initializer_list<int> tail) {
    path.insert(path.end(), tail);
    return path;
  }

  void Require(const std::vector<int>& path, const std::string& name) {
    if (!documented_.contains(path)) missing_.push_back(name);
  }

  const FileDescriptorProto& file_;
  std::map<std::vector<int>, std::string> documented_;
  std::vector<std::string> missing_;
};

TEST(ProtoContractTest, DescriptorSetHoldsTheWholePackage) {
  auto files = TesseraFiles(LoadDescriptorSet());
  std::vector<std::string> names;
  for (const auto& file : files) names.push_back(file.name());
  for (const char* expected :
       {"tessera/v1/job.proto", "tessera/v1/coordinator_service.proto",
        "tessera/v1/node_service.proto", "tessera/v1/worker_service.proto",
        "tessera/v1/trainer.proto", "tessera/v1/layout.proto", "tessera/v1/metrics.proto",
        "tessera/v1/checkpoint.proto", "tessera/v1/node.proto", "tessera/v1/model.proto"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }
}

TEST(ProtoContractTest, EveryElementIsDocumented) {
  for (const auto& file : TesseraFiles(LoadDescriptorSet())) {
    ASSERT_TRUE(file.has_source_code_info()) << file.name() << " lacks source info";
    auto missing = DocChecker(file).Undocumented();
    EXPECT_TRUE(missing.empty()) << file.name() << ": no comment on "
                                 << absl::StrJoin(missing, ", ");
  }
}

std::string UpperSnake(const std::string& camel) {
  std::string out;
  for (size_t i = 0; i < camel.size(); ++i) {
    char c = camel[i];
    if (std::isupper(static_cast<unsigned char>(c)) && i > 0) out += '_';
    out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return out;
}

TEST(ProtoContractTest, NamesFollowTheStyleGuide) {
  const std::regex snake("^[a-z][a-z0-9]*(_[a-z0-9]+)*$");
  const std::regex camel("^[A-Z][A-Za-z0-9]*$");
  for (const auto& file : TesseraFiles(LoadDescriptorSet())) {
    std::vector<const DescriptorProto*> messages;
    for (const auto& m : file.message_type()) messages.push_back(&m);
    for (size_t i = 0; i < messages.size(); ++i) {
      const DescriptorProto& message = *messages[i];
      EXPECT_TRUE(std::regex_match(message.name(), camel)) << message.name();
      for (const auto& field : message.field()) {
        EXPECT_TRUE(std::regex_match(field.name(), snake)) << message.name() << "." << field.name();
      }
      for (const auto& nested : message.nested_type()) messages.push_back(&nested);
    }
    for (const auto& enumeration : file.enum_type()) {
      // Top-level enum values share one C++ namespace, so each carries its
      // enum's name as a prefix, and 0 is the UNSPECIFIED value.
      std::string prefix = UpperSnake(enumeration.name()) + "_";
      ASSERT_GT(enumeration.value_size(), 0) << enumeration.name();
      EXPECT_EQ(enumeration.value(0).number(), 0) << enumeration.name();
      EXPECT_EQ(enumeration.value(0).name(), prefix + "UNSPECIFIED") << enumeration.name();
      for (const auto& value : enumeration.value()) {
        EXPECT_TRUE(value.name().starts_with(prefix)) << value.name() << " lacks " << prefix;
      }
    }
  }
}

TEST(ProtoContractTest, GeneratedCodeMatchesTheProtoFiles) {
  // The generated library and the descriptor set come from the same .proto
  // files; a stale library would disagree on fields.
  std::map<std::string, const DescriptorProto*> by_name;
  auto set = LoadDescriptorSet();
  for (const auto& file : set.file()) {
    for (const auto& m : file.message_type()) by_name[file.package() + "." + m.name()] = &m;
  }
  for (const auto* descriptor :
       {v1::JobSpec::descriptor(), v1::Job::descriptor(), v1::JobEvent::descriptor(),
        v1::TrainerTask::descriptor(), v1::HeartbeatRequest::descriptor()}) {
    ASSERT_TRUE(by_name.contains(descriptor->full_name())) << descriptor->full_name();
    const DescriptorProto& from_file = *by_name[descriptor->full_name()];
    ASSERT_EQ(descriptor->field_count(), from_file.field_size()) << descriptor->full_name();
    for (int i = 0; i < descriptor->field_count(); ++i) {
      EXPECT_EQ(descriptor->field(i)->name(), from_file.field(i).name());
      EXPECT_EQ(descriptor->field(i)->number(), from_file.field(i).number());
    }
  }
  const auto* coordinator = v1::Coordinator::service_full_name();
  EXPECT_STREQ(coordinator, "tessera.v1.Coordinator");
  EXPECT_STREQ(v1::NodeService::service_full_name(), "tessera.v1.NodeService");
}

TEST(ProtoContractTest, JobSpecRoundTripsThroughTheWireFormat) {
  v1::JobSpec spec;
  spec.set_name("gpt2-smoke");
  spec.mutable_model()->set_preset("gpt2-124m");
  spec.mutable_batch()->set_global_batch_size(512);
  spec.mutable_batch()->set_micro_batch_size(8);
  auto* layout = spec.mutable_parallelism()->mutable_layout();
  layout->set_data_parallel(8);
  layout->set_zero_stage(1);
  spec.mutable_checkpoint()->set_resume(false);
  (*spec.mutable_labels())["team"] = "pretraining";

  std::string wire;
  ASSERT_TRUE(spec.SerializeToString(&wire));
  v1::JobSpec parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_EQ(parsed.name(), "gpt2-smoke");
  EXPECT_EQ(parsed.model().preset(), "gpt2-124m");
  EXPECT_EQ(parsed.parallelism().choice_case(), v1::ParallelismSpec::kLayout);
  EXPECT_EQ(parsed.parallelism().layout().data_parallel(), 8);
  // `optional` keeps "explicitly false" apart from "unset".
  EXPECT_TRUE(parsed.checkpoint().has_resume());
  EXPECT_FALSE(parsed.checkpoint().resume());
  EXPECT_EQ(parsed.labels().at("team"), "pretraining");
}

}  // namespace
}  // namespace tessera
