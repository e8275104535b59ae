// Protobuf logs an ERROR line for each string field with invalid UTF-8 that it parses, which fuzz
// inputs hold all the time: targets that parse protos call this from LLVMFuzzerInitialize.
#pragma once

#include "google/protobuf/stubs/logging.h"

namespace tessera::fuzz {

inline void SilenceProtobufLogs() { google::protobuf::SetLogHandler(nullptr); }

}  // namespace tessera::fuzz
